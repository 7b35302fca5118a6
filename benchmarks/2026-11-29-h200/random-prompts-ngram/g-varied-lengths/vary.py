"""`trio-mlx bench --engine` with each request's max_tokens drawn uniformly from [max/2, 3max/2]
(seeded; the mean is --max-tokens), so rows end apart as served traffic's do: with VARY=1."""
import os
import random
import runpy
import sys

from trio_mlx.bench import _engine

_one = _engine._one
rng = random.Random(7)


async def one(engine, prompt, max_tokens, rec):
    n = rng.randint(max_tokens // 2, max_tokens * 3 // 2) if os.environ.get("VARY") == "1" else max_tokens
    await _one(engine, prompt, n, rec)


_engine._one = one
sys.argv = ["trio_mlx.cli", *sys.argv[1:]]
runpy.run_module("trio_mlx.cli", run_name="__main__")
