"""Several named LoRA adapters over one loaded model, each row of a batch on its own (or on none).

`apply_adapters` reads each adapter with mlx-lm's own `load_adapters` (its checks of
names and shapes, its reading of `adapter_config.json`), takes every `LoRALinear` it made
apart again, and puts in each targeted linear's place one `MultiLoRALinear` holding every
adapter's A and B stacked along a first axis: slot 0 is zeros (no adapter), slot i the
i-th adapter given. Adapters of different ranks are padded with zeros to the largest
rank (a zero column of A meets a zero row of B: the same product), and an adapter that
does not target a layer another one targets has zeros there: any mix of ranks and
targets over the same base model works. Only LoRA on linear layers: DoRA, a full
fine-tune, and LoRA on embeddings or expert layers are refused at load.

Which slot each row takes is `AdapterRows`, one object all the layers share: the
actor sets it before every forward and clears it after (`actor/_batch.py`). With no
row on an adapter the layers run the base linear alone, exactly the model's own
computation; with all rows on one, one matmul pair with that adapter's weights, as
mlx-lm's `LoRALinear` computes it; with a mix, `mx.gather_mm` picks each row's A and B
on the device for a decode step on a GPU, without copying them per row, and a prefill (or
the CPU) takes each row's A and B into a batched matmul.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .._errors import ModelLoadError


class AdapterRows:
    """The adapter slot of each row of the next forward (0: none), read by every
    `MultiLoRALinear` while the forward builds its graph. `index` (one slot per row, uint32
    as mlx-lm gives `gather_mm` its experts) for a mix; else `single`, the one slot every
    row takes (0: none)."""

    __slots__ = ("names", "index", "single")

    def __init__(self, names: tuple[str, ...]):
        self.names = names  # slot i + 1 is names[i]
        self.index: Any = None
        self.single = 0

    def slot(self, name: str | None) -> int:
        """The slot of the adapter called `name` (None: no adapter, 0); KeyError if unknown."""
        if name is None:
            return 0
        return self.names.index(name) + 1 if name in self.names else _unknown(name)

    def set(self, slots: list[int], index: Any = None) -> None:
        """Rows take `slots`; `index`, if given, is `slots` as an array already built."""
        first = slots[0] if slots else 0
        if all(s == first for s in slots):
            self.index, self.single = None, first
        else:
            self.index = mx.array(slots, dtype=mx.uint32) if index is None else index
            self.single = 0

    def clear(self) -> None:
        self.index, self.single = None, 0


def _unknown(name: str) -> int:
    raise KeyError(name)


class MultiLoRALinear(nn.Module):
    """A linear layer with every adapter's low-rank update beside it: `linear(x)` plus, for
    each row, `scale * (x @ A[slot]) @ B[slot]` of that row's slot (`AdapterRows`)."""

    def __init__(self, linear: nn.Module, lora_a: Any, lora_b: Any, scales: list[float], rows: AdapterRows):
        super().__init__()
        self.linear = linear
        self.lora_a = lora_a  # (slots, input dims, rank)
        self.lora_b = lora_b  # (slots, rank, output dims)
        self.scales = mx.array(scales, dtype=mx.float32)  # (slots,)
        self._rows = rows  # plain objects, not parameters: the selector, and each slot's own
        self._slot = _Slots([(lora_a[k], lora_b[k], scale) for k, scale in enumerate(scales)])
        # mx.gather_mm serves a mixed batch's decode steps on a GPU only. MLX's CPU gather_mm
        # takes float32 alone; on CUDA the warm-up's rehearsal (a mixed group's prefill beside
        # a constrained row) failed in it with "cuGraphAddKernelNode: invalid argument", which
        # a take of each row's A and B and a batched matmul do not (gather_mm alone at those
        # shapes passed: the cause inside MLX is not isolated; BENCHMARKS.md, "Adapters")
        self._gather = mx.default_device().type == mx.DeviceType.gpu

    def __call__(self, x: Any) -> Any:
        y = self.linear(x)
        rows = self._rows
        index = rows.index
        if index is None:
            k = rows.single
            if not k:
                return y
            a, b, scale = self._slot.of[k]  # mlx-lm's `LoRALinear`, op for op
            z = (x @ a) @ b
            z = scale * z
            return y + (z if z.dtype == x.dtype else z.astype(x.dtype))
        if index.shape[0] != x.shape[0]:
            raise ValueError(f"adapter rows: {index.shape[0]} slots for a batch of {x.shape[0]} rows")
        if self._gather and x.shape[-2] == 1:  # a decode step: each row's A and B read in place
            z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=index), self.lora_b, rhs_indices=index)
        else:  # a prefill, or the CPU (whose gather_mm takes float32 only): each row's A and B copied once
            z = (x @ self.lora_a[index]) @ self.lora_b[index]
        z = self.scales[index].astype(z.dtype).reshape((-1,) + (1,) * (z.ndim - 1)) * z
        return y + (z if z.dtype == x.dtype else z.astype(x.dtype))


class _Slots:
    """Each slot's (A, B, scale): views of the stacked arrays, read by the one-adapter path
    without an indexing op per call (a plain object: nn.Module keeps it out of the parameters)."""

    __slots__ = ("of",)

    def __init__(self, of: list[tuple[Any, Any, float]]):
        self.of = of


def apply_adapters(model: Any, adapters: Mapping[str, pathlib.Path],
                   load: Callable[[Any, pathlib.Path, str], None]) -> AdapterRows:
    """Put every adapter of `adapters` ({name: its checked directory}, slots 1.. in that order)
    into `model` as `MultiLoRALinear` layers; returns the rows' selector they share. `load` is
    `_models.load_adapter` (mlx-lm's `load_adapters` with its errors mapped). A directory that
    is not a LoRA adapter of linear layers, or not one for this model's shapes, is a
    ModelLoadError naming the adapter."""
    from mlx_lm.tuner.lora import LoRALinear

    found: dict[str, dict[int, tuple[Any, Any, float]]] = {}
    for slot, (name, where) in enumerate(adapters.items(), 1):
        path = str(where)
        kind = json.loads((where / "adapter_config.json").read_text(encoding="utf-8")).get("fine_tune_type", "lora")
        if kind != "lora":
            raise ModelLoadError(f"adapter {name!r} ({str(path)!r}) is a {kind!r} adapter: only LoRA adapters "
                                 "can be served side by side (adapter_path applies any kind to every request)")
        before = {p: type(m) for p, m in model.named_modules()}
        load(model, where, f"could not apply the adapter {name!r} at {path!r}")
        changed = [(p, m) for p, m in model.named_modules() if p in before and type(m) is not before[p]]
        for p, m in changed:
            if type(m) is not LoRALinear:
                raise ModelLoadError(f"adapter {name!r} ({str(path)!r}) adapts {p}, a {type(m).__name__}: only "
                                     "LoRA on linear layers can be served side by side")
            found.setdefault(p, {})[slot] = (m.lora_a, m.lora_b, float(m.scale))
        model.update_modules(tree_unflatten([(p, m.linear) for p, m in changed]))  # the base layers back
    rows = AdapterRows(tuple(adapters))
    if not found:
        return rows
    modules = dict(model.named_modules())
    rank = max(a.shape[1] for per in found.values() for a, _, _ in per.values())
    multi = []
    for p, per in found.items():
        a0, b0, _ = next(iter(per.values()))
        dtypes = {a.dtype for a, _, _ in per.values()} | {b.dtype for _, b, _ in per.values()}
        dtype = a0.dtype if len(dtypes) == 1 else mx.float32
        n_in, n_out = a0.shape[0], b0.shape[1]
        a_all = mx.zeros((len(adapters) + 1, n_in, rank), dtype=dtype)
        b_all = mx.zeros((len(adapters) + 1, rank, n_out), dtype=dtype)
        scales = [0.0] * (len(adapters) + 1)
        for slot, (a, b, scale) in per.items():
            r = a.shape[1]
            a_all[slot, :, :r] = a.astype(dtype)
            b_all[slot, :r, :] = b.astype(dtype)
            scales[slot] = scale
        mx.eval(a_all, b_all)
        layer = MultiLoRALinear(modules[p], a_all, b_all, scales, rows)
        multi.append((p, layer))
    model.update_modules(tree_unflatten(multi))
    return rows
