"""The physical limit of a decode step: the bytes it must read over the device's memory bandwidth.

A decode step reads every weight once and, for each row, the K and V of every
token of its context, in every layer. So

    bytes per step = weight bytes + KV bytes per token x context tokens x rows
    KV bytes per token = layers x 2 x kv_heads x head_dim x dtype bytes

and no step can take less than bytes / bandwidth. `trio-mlx bench` records a
model's bytes in its results (`physical`) and `trio-mlx bench table` puts each
closed-loop level's fraction of that limit beside its figures: the least step
time at its concurrency and mean context over its TPOT p50 (the time a row
waited per decode step, prefills of others included).

Pure Python: a server run (`--url`) reads the weights' bytes from the
safetensors headers without loading MLX; `--limit` sums the loaded model's
parameters (`trio_mlx.actor.ceiling.model_bytes`), which the tests check
come to the same.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Memory bandwidth in GB/s (1e9 bytes/s) by a substring of the device's name as MLX reports
# it (`mx.device_info()["device_name"]`), first match wins: the vendors' published peaks.
# Apple's figure is the largest configuration of each chip (a binned M3 Max: 300, not 400).
KNOWN_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0),  # before "H200": its name contains it
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("M1 Ultra", 800.0), ("M1 Max", 400.0), ("M1 Pro", 200.0), ("M1", 68.25),
    ("M2 Ultra", 800.0), ("M2 Max", 400.0), ("M2 Pro", 200.0), ("M2", 100.0),
    ("M3 Ultra", 819.0), ("M3 Max", 400.0), ("M3 Pro", 150.0), ("M3", 100.0),
    ("M4 Max", 546.0), ("M4 Pro", 273.0), ("M4", 120.0),
)  # fmt: skip

# safetensors dtype names -> bytes per element
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip
_FLOATS = {"F64", "F32", "F16", "BF16"}


def known_bandwidth(device_name: str | None) -> float | None:
    """The memory bandwidth (GB/s) of a device MLX names `device_name`, if the table knows it."""
    if not device_name:
        return None
    for key, gbs in KNOWN_BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return gbs
    return None


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x dtype bytes, from a model's config.json."""
    cfg = config.get("text_config", config)  # a multimodal model's language half
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def safetensors_tensors(model_dir: str | Path) -> list[tuple[str, int]]:
    """(dtype, bytes) of every tensor in the model's *.safetensors files, read from their headers."""
    out: list[tuple[str, int]] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                lo, hi = t["data_offsets"]
                out.append((t["dtype"], hi - lo))
    return out


def footprint(weight_bytes: int, kv_dtype_bytes: int, config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """What `physical` records of a model: its weights' bytes and the KV bytes of one token."""
    return {
        "weight_bytes": int(weight_bytes),
        "kv_dtype_bytes": int(kv_dtype_bytes),
        "kv_bytes_per_token": kv_bytes_per_token(config, kv_dtype_bytes),
        "source": source,
    }


def footprint_from_files(model_dir: str | Path) -> dict[str, Any]:
    """The footprint from the safetensors headers and config.json, without MLX. The KV
    cache's dtype is taken as the float dtype holding most of the weights' float bytes
    (a quantized model's scales and norms: its activations' dtype)."""
    tensors = safetensors_tensors(model_dir)
    if not tensors:
        raise ValueError(f"no *.safetensors in {model_dir}")
    by_dtype: dict[str, int] = {}
    for dtype, size in tensors:
        if dtype in _FLOATS:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    kv_dtype = max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "BF16"
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return footprint(sum(s for _, s in tensors), _DTYPE_BYTES[kv_dtype], config, "safetensors")


def mean_context(prompt_tokens: int, max_tokens: int) -> float:
    """The mean context of a request's decode steps: the prompt and half its output."""
    return prompt_tokens + max_tokens / 2


def step_bytes(fp: Mapping[str, Any], rows: int, context: float) -> float:
    """Bytes one decode step of `rows` rows at `context` tokens each must read."""
    return float(fp["weight_bytes"]) + float(fp["kv_bytes_per_token"]) * context * rows


def fraction_of_limit(
    level: Mapping[str, Any], fp: Mapping[str, Any], bandwidth_gbs: float, prompt_tokens: int, max_tokens: int
) -> float | None:
    """The least time a closed-loop level's decode step can take (its bytes over the
    bandwidth, at its concurrency and mean context) over its TPOT p50; None for a Poisson
    level or one without a TPOT."""
    rows = level.get("rows") or level.get("concurrency")  # a bare level's rows: its concurrency, or fewer
    tpot = (level.get("tpot_ms") or {}).get("p50")
    if not rows or not tpot or bandwidth_gbs <= 0:
        return None
    least_ms = step_bytes(fp, rows, mean_context(prompt_tokens, max_tokens)) / (bandwidth_gbs * 1e9) * 1e3
    return least_ms / float(tpot)
