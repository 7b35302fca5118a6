"""`trio-mlx model`: convert the embedded default (`default`) or build a random-weight test
model (`build`), and print the model directory's path."""

from __future__ import annotations

import argparse
import pathlib
import sys

from .._errors import ModelLoadError
from ._cache import default_cache_dir
from ._models import ensure_embedded_model
from ._test_models import SHAPES, build_test_model


def main(argv: list[str] | None = None) -> int:
    """Prepare a model directory and print its path."""
    parser = argparse.ArgumentParser(prog="trio-mlx model", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    default = sub.add_parser("default", help="convert the embedded default model (once)")
    default.add_argument("--cache-dir", type=pathlib.Path, default=default_cache_dir(),
                         help="default: %(default)s")
    build = sub.add_parser("build", help="build a random-weight test model")
    build.add_argument("out", type=pathlib.Path)
    build.add_argument("--shape", choices=list(SHAPES), default="tiny")
    build.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    build.add_argument("--bits", type=int, choices=[4, 8], help="quantize (group size 64)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--tools", action="store_true", help="a chat template with tool calling")
    build.add_argument("--tokenizer", type=pathlib.Path, metavar="MODEL_DIR",
                       help="that model's tokenizer and chat template, and a vocabulary its size, in place "
                            "of the test tokenizer: a random model that tokenizes as a real one (for "
                            "grammar benchmarks, whose JSON the test tokenizer spells a byte a token)")
    build.add_argument("--spelled-padding", action="store_true",
                       help="make 16k ids past the tokenizer's own encode back from their text, and "
                            "greedy decoding sample only those and the tokenizer's own, so that a "
                            "random model's answers tokenize back as a real model's do (for multi-turn "
                            "benchmarks)")
    args = parser.parse_args(argv)
    try:
        if args.command == "default":
            path = ensure_embedded_model(args.cache_dir)
        else:
            path = build_test_model(args.out, shape=args.shape, dtype=args.dtype,
                                    seed=args.seed, quantize_bits=args.bits, tools=args.tools,
                                    spelled_padding=args.spelled_padding, tokenizer=args.tokenizer)
    except (ModelLoadError, OSError, ValueError) as exc:
        print(f"trio-mlx model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
