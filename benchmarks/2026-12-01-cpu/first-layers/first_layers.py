"""A model's first N layers with its own final norm and head, as a draft model directory.

    PYTHONPATH=. python benchmarks/2026-12-01-cpu/first-layers/first_layers.py MODEL_DIR N OUT_DIR

Copies MODEL_DIR's files, keeps the weights of layers 0..N-1 (and every weight outside the
layers), and sets `num_hidden_layers` to N. For Llama-style checkpoints (`model.layers.I.`).
"""
import json
import pathlib
import shutil
import sys

import trio_mlx.models  # noqa: F401 - before mlx.core: on a Linux CPU it puts OpenBLAS under MLX


def main() -> None:
    import mlx.core as mx

    src, n, out = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = n
    (out / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(src / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
    mx.save_safetensors(str(out / "model.safetensors"), kept)
    print(f"{n} layers: {len(kept)} of {len(weights)} weights")


if __name__ == "__main__":
    main()
