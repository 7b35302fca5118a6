"""The quantized KV cache's settings (`kv_bits`, `kv_group_size`, `quantized_kv_start`): checked
once in `ActorTuning`, for the library and the server alike; what cannot go with it is refused
before anything loads (the model's own checks, its head dim, are in tests/integration/test_kv_bits.py)."""

from __future__ import annotations

import pytest

from trio_mlx import ActorTuning, Engine
from trio_mlx.server._serve import build_parser, settings_from_args
from trio_mlx.server._settings import Settings


def test_the_flags_and_variables_reach_the_tuning():
    args = build_parser().parse_args(["--kv-bits", "4", "--kv-group-size", "32"])
    tuning = settings_from_args(args).tuning
    assert (tuning.kv_bits, tuning.kv_group_size, tuning.quantized_kv_start) == (4, 32, 0)
    assert Settings.from_env({"TRIO_MLX_KV_BITS": "8"}).tuning.kv_bits == 8
    assert Engine(None, kv_bits=8, kv_group_size=128).tuning.kv_group_size == 128


@pytest.mark.parametrize(("knobs", "message"), [
    ({"kv_bits": 7}, "kv_bits must be one of 2, 3, 4, 5, 6, 8"),
    ({"kv_bits": True}, "kv_bits must be one of"),
    ({"kv_bits": 8, "kv_group_size": 48}, "kv_group_size must be one of 32, 64, 128"),
    ({"kv_bits": 8, "quantized_kv_start": 5000}, "quantized_kv_start must be 0"),
    ({"quantized_kv_start": -1}, "quantized_kv_start must be >= 0"),
])
def test_what_cannot_work_is_refused_by_name(knobs, message):
    with pytest.raises(ValueError, match=message):
        ActorTuning(**knobs)
    with pytest.raises(ValueError, match=message):
        Engine(None, **knobs)


def test_every_bit_width_mlx_quantizes_is_taken():
    assert [ActorTuning(kv_bits=b).kv_bits for b in (2, 3, 4, 5, 6, 8)] == [2, 3, 4, 5, 6, 8]


def test_a_distributed_group_refuses_it():
    with pytest.raises(ValueError, match="kv_bits needs a single rank"):
        Settings.from_env({}, kv_bits=8, distributed="tensor")
