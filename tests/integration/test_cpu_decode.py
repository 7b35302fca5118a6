"""The CPU decode path's layer swaps (`trio_mlx/models/_cpu_decode.py`): each computes what
the layer it replaces does, `load_model` puts them in place on the CPU only, and a model
loaded with them decodes the same tokens as mlx_lm's own, one row or a batch."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model as mlx_load_model

from trio_mlx import models
from trio_mlx.models import _cpu_decode, _models


def rows(n: int, cols: int, seed: int) -> mx.array:
    return mx.random.normal((n, cols), key=mx.random.key(seed))


def test_one_row_products_run_in_row_blocks_of_the_same_weight() -> None:
    lin = nn.Linear(64, 2500)
    lin.__class__ = _cpu_decode.RowBlockLinear
    x = rows(1, 64, 1)
    y = lin(x)
    blocks = lin.__dict__["_row_blocks"]
    assert [b.shape[0] for b in blocks.views] == [834, 834, 832]  # equal, each <= BLOCK_ROWS
    assert blocks.weight is lin.weight and "_row_blocks" not in dict(lin.parameters())
    assert y.shape == (1, 2500)
    assert mx.allclose(y, x @ lin.weight.T + lin.bias, atol=1e-5).item()
    batch = rows(3, 64, 2)  # more than one row: one matmul, as nn.Linear
    assert mx.array_equal(lin(batch), mx.addmm(lin.bias, batch, lin.weight.T)).item()
    lin.update({"weight": rows(1500, 64, 3), "bias": mx.zeros((1500,))})  # split anew
    assert [b.shape[0] for b in lin.__dict__["_row_blocks"].views] == [834, 834, 832]
    assert mx.allclose(lin(x[None]), (x @ lin.weight.T + lin.bias)[None], atol=1e-5).item()
    assert [b.shape[0] for b in lin.__dict__["_row_blocks"].views] == [750, 750]


def test_small_or_non_float32_weights_keep_one_matmul() -> None:
    for lin in (nn.Linear(64, 1024, bias=False), nn.Linear(64, 3000, bias=False)):
        if lin.weight.shape[0] > 1024:
            lin.weight = lin.weight.astype(mx.bfloat16)
        lin.__class__ = _cpu_decode.RowBlockLinear
        x = rows(1, 64, 4).astype(lin.weight.dtype)
        assert mx.array_equal(lin(x), x @ lin.weight.T).item()
        assert lin.__dict__["_row_blocks"].views == ()


def test_a_tied_output_projection_runs_in_row_blocks() -> None:
    emb = nn.Embedding(3000, 64)
    ids = mx.array([[5, 2999]])
    before = emb(ids)
    emb.__class__ = _cpu_decode.RowBlockEmbedding
    x = rows(1, 64, 5)[None]
    assert mx.allclose(emb.as_linear(x), x @ emb.weight.T, atol=1e-5).item()
    assert len(emb.__dict__["_row_blocks"].views) == 3
    assert mx.array_equal(emb(ids), before).item()  # the lookup is untouched


def test_compiled_rms_norm_is_mx_fast_rms_norm() -> None:
    norm = nn.RMSNorm(96, eps=1e-5)
    norm.weight = mx.random.uniform(0.5, 1.5, (96,), key=mx.random.key(6))
    x = mx.random.normal((2, 5, 96), key=mx.random.key(7))
    want = mx.fast.rms_norm(x, norm.weight, 1e-5)
    norm.__class__ = _cpu_decode.CompiledRMSNorm
    assert mx.allclose(norm(x), want, atol=1e-6).item()
    assert mx.allclose(norm(x[:, :1]), want[:, :1], atol=1e-6).item()  # another shape
    half = x.astype(mx.bfloat16)  # other dtypes keep mx.fast.rms_norm
    assert mx.array_equal(norm(half), mx.fast.rms_norm(half, norm.weight, 1e-5)).item()


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims,scale", [(64, 1.0), (32, 0.25)])
def test_decode_rope_is_mx_fast_rope(traditional: bool, dims: int, scale: float) -> None:
    rope = nn.RoPE(dims, traditional=traditional, base=100000.0, scale=scale)
    fast = _cpu_decode.DecodeRoPE(dims, traditional=traditional, base=100000.0, scale=scale)
    one = mx.random.normal((1, 9, 1, 64), key=mx.random.key(8))
    three = mx.random.normal((3, 3, 1, 64), key=mx.random.key(9))
    for x, offset in ((one, 0), (one, 17), (one, mx.array(130)), (three, mx.array([0, 5, 7211])),
                      (three, 4000)):
        got, want = fast(x, offset=offset), rope(x, offset=offset)
        assert got.shape == want.shape and mx.array_equal(got, want).item(), offset  # same floats
    prompt = mx.random.normal((1, 9, 6, 64), key=mx.random.key(10))  # prompts keep mx.fast.rope
    assert mx.array_equal(fast(prompt, offset=3), rope(prompt, offset=3)).item()


def decode(model: nn.Module, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens per prompt through mlx_lm's BatchGenerator, as the actor runs it."""
    gen = BatchGenerator(model, max_tokens=steps, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=[steps] * len(prompts))
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(len(t) < steps for t in out.values()):
        _, generated = gen.next()
        for r in generated:
            out[r.uid].append(r.token)
    gen.close()
    return [out[uid] for uid in uids]


def swapped(model: nn.Module) -> set[str]:
    return {type(m).__name__ for _, m in model.named_modules() if type(m).__module__ == _cpu_decode.__name__}


def test_load_model_swaps_on_the_cpu_and_decodes_as_mlx_lm(
    tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 100 rows split the tiny model's 128-row MLP and its 512-row tied output.
    monkeypatch.setattr(_cpu_decode, "BLOCK_ROWS", 100)
    ours, _ = models.load_model(tiny_model_fp32)
    stock, _ = mlx_load_model(tiny_model_fp32)
    want = {"CompiledRMSNorm", "DecodeRoPE"}
    if models.cpu_blas_status().optimized:
        want |= {"RowBlockLinear", "RowBlockEmbedding"}
    assert swapped(ours) == want and not swapped(stock)
    prompts = [[1, 40, 50, 60, 70], [1, 80, 90]]
    for batch in ([prompts[0]], prompts):  # one row (row blocks), two (per-row RoPE offsets)
        assert decode(ours, batch, 12) == decode(stock, batch, 12)
    if "RowBlockEmbedding" in want:
        assert len(ours.model.embed_tokens.__dict__["_row_blocks"].views) == 6
    x = mx.array([prompts[0]])
    assert mx.allclose(ours(x), stock(x), atol=1e-4).item()


def test_the_swaps_are_cpu_only(tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = mx.Device(mx.DeviceType.gpu)
    monkeypatch.setattr(_models.mx, "default_device", lambda: gpu)  # what load_model checks
    model, _ = models.load_model(tiny_model_fp32)
    assert not swapped(model)


def test_without_row_blocks_only_norm_and_rope_are_swapped(tiny_model_fp32: Path) -> None:
    model, _ = mlx_load_model(tiny_model_fp32)
    n = _cpu_decode.install(model, row_blocks=False)
    assert swapped(model) == {"CompiledRMSNorm", "DecodeRoPE"}
    assert n == len([m for _, m in model.named_modules() if isinstance(m, (nn.RMSNorm, nn.RoPE))])
