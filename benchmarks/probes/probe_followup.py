"""Probe (GPU investigation): where a cached follow-up's time to first token goes, against a
fresh prompt of its new tokens alone.

    python benchmarks/probes/probe_followup.py MODEL_DIR [REPEATS]

An agent's turn adds a few dozen tokens to a long conversation whose KV the prompt cache
holds. On an H100 (1B, bf16; benchmarks/2026-11-27-h100/prefix-grain/, step trace) such a
follow-up's prefill `next()` took 8-17 ms and the step that sampled its first token 6-9.5,
where a fresh 65-token prompt took 7 and 5: the follow-up prefills its new tokens plus what
the grain leaves uncached (`_shapes.GRID_PREFIX`) behind ~7.7k cached ones. This splits that:

- `fresh N`: a one-row BatchGenerator over the actor's grid-prefilling model
  (`_batch.CausalPrefill`, the grid on CUDA only) given N new tokens, each `next()` until the
  first token is out, in ms;
- `follow P+N`: the same with P tokens handed over as cached KV (`insert(..., caches=...)`,
  as `_reuse.Reuse.lookup` does);
- `merge P`: `BatchKVCache.merge` of the P cached tokens alone (what the generator does with
  the caches it is given before its forward);
- `forward P+N`: the grid model's forward of N tokens behind the merged P, alone;
- `decode P`: a steady decode step of the one row behind P (+N) tokens;
- `batch of 8 behind P`: a turn of 8 conversations in step (the chat bench's): a steady decode
  step of the 8 rows, the step after 7 of them leave, and 7 follow-ups entering together to
  their first tokens (at 8 conversations the H100 trace showed 26-28, 51-65 and 32-41 ms
  steps around a turn, against ~10 for a steady one);
- `fresh enter beside a row at P`: ROWS-1 fresh prompts entering together beside one row
  decoding behind P tokens, to their first tokens and the decode step after, against the same
  entering an empty batch (the batch pads every row's KV to its longest row's).

Each is run two ways, in turn: `stock`, and `kept`, where the `mx.clear_cache()` that mlx-lm's
prompt processing calls after every prefill chunk (and after rolling its padding) does nothing,
so MLX's buffer cache keeps what the prefill freed (it stays bounded by its cache limit): the
first decode step after a prefill (6-9.5 ms behind ~7.7k cached tokens on the H100, against
5.5 steady) may be paying to allocate its buffers again.

Every figure is the median of REPEATS (default 5) runs with other random tokens, the device
idle before and after each timed call; warm-up builds the grid's one-row shapes first, as the
server's does. On the CPU build it runs too (no grid), to check the probe itself.
"""
import functools
import statistics
import sys
import time

import mlx.core as mx
from gpu_timing import load, steps_to_first_token, timed  # benchmarks/probes/, the script's folder
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.actor._batch import CausalPrefill, remove_rows
from trio_mlx.actor._shapes import GRID_PREFIX, grid_sizes, prefill_grid
from trio_mlx.actor._warmup import prebuild_prefill

model, layers, vocab = load(sys.argv[1])
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
grid = prefill_grid()
forward = CausalPrefill(model, grid=grid)
gpu = mx.default_device().type == mx.DeviceType.gpu
cached_lengths = (6144, 7680) if gpu else (256,)
new_lengths = (64, 300, 500) if gpu else (16, 48)
if grid:
    t0 = time.perf_counter()
    print("prebuilt", prebuild_prefill(forward, layers, 1, 8192, grid_sizes(2048), GRID_PREFIX),
          f"one-row shapes in {time.perf_counter() - t0:.2f} s", flush=True)
bg = BatchGenerator(forward, max_tokens=4, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=2048)


def ids(n: int) -> list[int]:
    return mx.random.randint(10, vocab - 10, (n,)).tolist()


def prefilled(tokens: list[int]) -> list[KVCache]:
    cache = [KVCache() for _ in range(layers)]
    mx.eval(model(mx.array([tokens]), cache=cache))
    mx.eval([a for c in cache for a in (c.keys, c.values)])
    return cache


def to_first_token(prompt: list[int], cache: list[KVCache] | None, prefix: list[int]) -> tuple[list[float], float]:
    """Each `next()` until the row's first token, then one steady decode step, in ms."""
    kw = {"caches": [cache], "all_tokens": [prefix]} if cache is not None else {}
    (uid,) = bg.insert([prompt], max_tokens=[4], **kw)
    steps = steps_to_first_token(bg, uid)
    decode = timed_step()
    while bg.next()[1]:
        pass
    return steps, decode


def merged_keys(cache: list[KVCache]) -> list[mx.array]:
    return [BatchKVCache.merge([c]).keys for c in cache]


def forward_alone(cache: list[KVCache], new: list[int]) -> mx.array:
    return forward(mx.array([new]), cache=[BatchKVCache.merge([c]) for c in cache])


def timed_step() -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    bg.next()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f}"


def steps_line(runs: list[tuple[list[float], float]]) -> str:
    return (f"to first token {fmt([sum(s) for s, _ in runs])} ms (steps "
            f"{' + '.join(fmt([s[i] for s, _ in runs]) for i in range(min(len(s) for s, _ in runs)))}),"
            f" decode {fmt([d for _, d in runs])}")


VARIANTS = ("stock", "kept")
keep_buffers = [False]
_clear_cache = mx.clear_cache


def clear_cache_unless_kept() -> None:
    if not keep_buffers[0]:
        _clear_cache()


mx.clear_cache = clear_cache_unless_kept  # mlx_lm.generate calls it as mx.clear_cache()

# a first pass, untimed: what a server's warm-up has also visited
to_first_token(ids(new_lengths[0]), None, [])
to_first_token(ids(new_lengths[0]), prefilled(ids(cached_lengths[0])), [])
for n in new_lengths:
    runs: dict[str, list[tuple[list[float], float]]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            keep_buffers[0] = v == "kept"
            runs[v].append(to_first_token(ids(n), None, []))
    for v in VARIANTS:
        print(f"fresh {n:5d} {v}: {steps_line(runs[v])}", flush=True)
for p in cached_lengths:
    for n in new_lengths:
        runs, merges, forwards = {v: [] for v in VARIANTS}, [], []
        for _ in range(repeats):
            prefix, new = ids(p), ids(n)
            cache = prefilled(prefix)
            merges.append(timed(functools.partial(merged_keys, cache)))
            forwards.append(timed(functools.partial(forward_alone, cache, new)))
            for v in VARIANTS:
                keep_buffers[0] = v == "kept"
                runs[v].append(to_first_token(new, cache, prefix))
        for v in VARIANTS:
            print(f"follow {p}+{n:4d} {v}: {steps_line(runs[v])}"
                  + (f"; merge {fmt(merges)}, forward {fmt(forwards)}" if v == VARIANTS[0] else ""), flush=True)

# A turn of ROWS conversations in step, as `trio-mlx bench chat` at 8 conversations runs them:
# ROWS rows decode behind P cached tokens each; all but one leave the batch (the actor's
# `remove_rows`) before a decode step; then ROWS-1 follow-ups enter together and step to their
# first tokens. Each change of the batch's rows builds new dense KV arrays for every row.
ROWS = 8
turns: dict[tuple[int, str], tuple[list[float], list[float], list[float]]] = {}
bg.completion_batch_size = bg.prefill_batch_size = ROWS
for p, v in [(p, v) for p in cached_lengths for _ in range(max(1, repeats // 2)) for v in VARIANTS]:
    keep_buffers[0] = v == "kept"
    steady, leaving, entering = turns.setdefault((p, v), ([], [], []))
    rows = [(ids(p), ids(new_lengths[0])) for _ in range(ROWS)]
    uids = bg.insert([new for _, new in rows], max_tokens=[64] * ROWS,
                     caches=[prefilled(prefix) for prefix, _ in rows], all_tokens=[prefix for prefix, _ in rows])
    steps_to_first_token(bg, uids[-1])
    for _ in range(3):
        bg.next()
    steady.append(timed_step())
    mx.synchronize()
    t0 = time.perf_counter()
    remove_rows(bg, uids[1:])
    bg.next()
    mx.synchronize()
    leaving.append(1e3 * (time.perf_counter() - t0))
    again = [(ids(p), ids(new_lengths[0])) for _ in range(ROWS - 1)]
    new_uids = bg.insert([new for _, new in again], max_tokens=[4] * (ROWS - 1),
                         caches=[prefilled(prefix) for prefix, _ in again],
                         all_tokens=[prefix for prefix, _ in again])
    entering.append(sum(steps_to_first_token(bg, new_uids[-1])))
    remove_rows(bg, [uids[0], *new_uids])
    while bg.next()[1]:
        pass
for (p, v), (steady, leaving, entering) in turns.items():
    print(f"batch of {ROWS} behind {p} {v}: steady decode {fmt(steady)} ms; {ROWS - 1} rows leave, then a step"
          f" {fmt(leaving)}; {ROWS - 1} follow-ups enter, to their first tokens {fmt(entering)}", flush=True)

# ROWS-1 fresh prompts entering together beside one row decoding behind P cached tokens, against
# entering an empty batch: mlx-lm's batch holds every row's KV in one array as long as its longest
# row, so rows entering beside a long one are padded to its length (at 8 chat conversations on an
# H100, 7 fresh ~60-token rows entered beside a ~8k-token row in a 68 ms step and the next steps
# took 18 and 11 ms, against 6-7 steady: benchmarks/2026-11-28-h100/agent-rounds/).
keep_buffers[0] = False
entries: dict[tuple[int, bool], tuple[list[float], list[float]]] = {}
for p, beside in [(p, b) for p in cached_lengths for _ in range(max(1, repeats // 2)) for b in (True, False)]:
    to_first, after = entries.setdefault((p, beside), ([], []))
    long_uids = []
    if beside:
        prefix = ids(p)
        long_uids = bg.insert([ids(new_lengths[0])], max_tokens=[64], caches=[prefilled(prefix)],
                              all_tokens=[prefix])
        steps_to_first_token(bg, long_uids[0])
        bg.next()
    fresh_uids = bg.insert([ids(new_lengths[0]) for _ in range(ROWS - 1)], max_tokens=[8] * (ROWS - 1))
    to_first.append(sum(steps_to_first_token(bg, fresh_uids[-1])))
    after.append(timed_step())
    remove_rows(bg, [*long_uids, *fresh_uids])
    while bg.next()[1]:
        pass
for p in cached_lengths:
    (b_first, b_after), (e_first, e_after) = entries[(p, True)], entries[(p, False)]
    print(f"{ROWS - 1} fresh of {new_lengths[0]} enter beside a row at {p}: to their first tokens {fmt(b_first)} ms,"
          f" a decode step after {fmt(b_after)}; into an empty batch {fmt(e_first)}, {fmt(e_after)}", flush=True)

