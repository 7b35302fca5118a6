"""Probe: what grammar masking costs the served batch, by the share of constrained rows.

    python benchmarks/probes/probe_grammar_engine.py MODEL_DIR [BATCH] [TOKENS] [ROUNDS] [string|array]

Asked through the runtime as a server runs it: an `Engine` (thread actor, warmed up) gets BATCH concurrent
`generate` requests of TOKENS tokens each, with 0%, 50% and 100% of them
carrying `response_format` (a JSON string of at least 100,000 characters:
the mask of a long string, where most tokens are allowed, every step, to
max_tokens); free rows run to max_tokens too (`ignore_eos`). The three shares alternate over ROUNDS rounds because the
host's speed drifts. Decode tokens/s counts the tokens that arrive once every
request has its first one, until the last ends. Prints each round and the
median ratio to 0%. With `array` the format is instead an
array of 60 strings of at most 12 characters each: a schema whose rows end
(their budget closes the JSON before max_tokens) and whose completion is long,
so the per-row budget checks run every step. Use a random-weight model
(`trio-mlx model build DIR --shape llama-3.2-1b --dtype bfloat16`).
"""

from __future__ import annotations

import statistics
import sys
import time

import trio

import trio_mlx

# A string no budget can complete (its shortest completion is past what the engine
# looks for, so the row is masked every step until max_tokens cuts it).
STRING = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 100_000}}}
ARRAY = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60, "maxItems": 60}}}
SHARES = (0.0, 0.5, 1.0)
FORMAT = STRING


async def level(engine: trio_mlx.Engine, batch: int, tokens: int, share: float) -> float:
    constrained = round(batch * share)
    first: list[float] = []
    counts = [0] * batch  # tokens each request has received
    marks: list[int] = []  # counts when every request had its first token
    done = time.perf_counter

    async def one(i: int) -> None:
        fmt = FORMAT if i < constrained else None
        async with engine.generate(f"Row {i}: a long JSON string about mountains.", max_tokens=tokens,
                                   temperature=0.0, ignore_eos=True, response_format=fmt) as events:
            async for ev in events:
                if isinstance(ev, trio_mlx.TextDelta):
                    if counts[i] == 0:
                        first.append(done())
                        if len(first) == batch:
                            marks.extend(counts)
                    counts[i] += len(ev.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(one, i)
    end = done()
    short = sum(c < tokens for c in counts)
    if short:  # the figure compares rows that all decode to max_tokens
        print(f"  note: {short} of {batch} rows ended before max_tokens ({int(share * 100)}% constrained)")
    return (sum(counts) - sum(marks)) / (end - max(first))


async def main() -> None:
    path = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    global FORMAT
    FORMAT = ARRAY if len(sys.argv) > 5 and sys.argv[5] == "array" else STRING
    async with trio_mlx.open_engine(path, max_batch=batch, prefill_batch=min(batch, 8)) as engine:
        # warm-up: the grammar path's kernels (an array needs room for its sure completion)
        await level(engine, batch, tokens if FORMAT is ARRAY else min(tokens, 32), 1.0)
        results: dict[float, list[float]] = {s: [] for s in SHARES}
        for r in range(rounds):
            for share in SHARES if r % 2 == 0 else reversed(SHARES):
                results[share].append(await level(engine, batch, tokens, share))
            print(f"round {r + 1}: " + ", ".join(f"{int(s * 100)}%: {results[s][-1]:.0f} tok/s" for s in SHARES),
                  flush=True)
        device = engine.info.device if engine.info else "?"
    base = statistics.median(results[0.0])
    for s in SHARES:
        med = statistics.median(results[s])
        print(f"{int(s * 100):3d}% constrained: median {med:.0f} tok/s, {med / base:.2f}x of free "
              f"(engine, batch {batch}, {tokens} tokens, {device})")


if __name__ == "__main__":
    trio.run(main)
