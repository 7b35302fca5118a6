"""Probe: what storing a finished row into the prompt cache costs the actor.

    python benchmarks/probes/probe_store_cost.py [MODEL_DIR] [ROWS]

A BatchGenerator decodes 64 rows of 128-token prompts; then, one finished row at
a time, as `Reuse.leaving` does: `copy_rows` builds the copies of its KV (lazy),
they are evaluated, and `PromptCache.store` indexes them. Prints the median ms of
each part over ROWS rows (40), then of a decode step. Without MODEL_DIR, a
random-weight model with the 1B shape's 16 layers and tiny widths: the host's part
depends on the layers, not on their width. benchmarks/2026-11-28-h200/buffer-cache/
says what it found on the CPU build.
"""
import random
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from trio_mlx.actor._batch import copy_rows
from trio_mlx.actor._prompt_cache import PromptCache
from trio_mlx.models import load_model

if len(sys.argv) > 1:
    model, config = load_model(sys.argv[1])
    vocab = int(config["vocab_size"])
else:
    vocab = 1000
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=16, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab))
    mx.eval(model.parameters())
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 40
clock = time.perf_counter
bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=64, prefill_batch_size=64)
rng = random.Random(0)
uids = bg.insert([[rng.randrange(3, vocab) for _ in range(128)] for _ in range(64)])
for _ in range(8):
    bg.next()
cache = PromptCache(1 << 40, None)
build, run, store = [], [], []
for uid in uids[:rows]:
    t0 = clock()
    copies = copy_rows(bg, {uid: 136})
    t1 = clock()
    mx.eval([[c.keys, c.values] for layers, _ in copies.values() for c in layers])
    t2 = clock()
    for layers, tokens in copies.values():
        cache.store(tokens, layers)
    build.append(t1 - t0)
    run.append(t2 - t1)
    store.append(clock() - t2)
steps = []
for _ in range(20):
    t0 = clock()
    bg.next()
    steps.append(clock() - t0)


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.3f} ms"


print(f"a finished row: copies built {ms(build)}, run {ms(run)}, indexed {ms(store)}; a decode step {ms(steps)}")
