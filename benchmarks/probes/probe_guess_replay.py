"""Prompt lookup replayed over greedy answers to the bench's random prompts: how often a
row's guesses open speculation, and how many drafts the steps they open keep, by the
number of the row's last guesses that hit when it speculated.

    PYTHONPATH=. python benchmarks/probes/probe_guess_replay.py MODEL --out answers.json [--first 24 --count 48]
    PYTHONPATH=. python benchmarks/probes/probe_guess_replay.py --replay answers.json

The answers are asked once (speculation off; greedy answers do not depend on drafts) for
`trio-mlx bench`'s prompts number FIRST.. FIRST+COUNT-1 (its seed 0, 128 tokens: with
`--concurrency 1,4,16 --requests-multiple 12 --min-requests 24` the level of four users
is prompts 24-71), and each answer is replayed through the actor's own `NgramIndex` and
`RowSpec` (`watch`, `drafts`, `record`, `known`) as one row decoding alone.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys

import trio


async def answers(model: str, first: int, count: int, tokens: int, prompt_tokens: int) -> dict[str, list[list[int]]]:
    import trio_mlx
    from trio_mlx.bench._prompts import load_tokenizer, make_prompts

    prompts = [list(p.ids) for p in make_prompts(load_tokenizer(model), first + count, prompt_tokens, seed=0)][first:]
    outs: list[list[int]] = [[] for _ in prompts]
    async with trio_mlx.open_engine(model, max_batch=max(1, len(prompts))) as engine:

        async def one(i: int) -> None:
            async with engine.generate(prompts[i], max_tokens=tokens, temperature=0, ignore_eos=True) as events:
                async for ev in events:
                    if isinstance(ev, trio_mlx.TextDelta):
                        outs[i] += list(ev.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return {"prompts": prompts, "outs": outs}


def replay(prompt: list[int], out: list[int], steps: list[tuple[int, int, int]], n: int = 3, most: int = 32) -> None:
    """Appends (hits in the guess window, drafts, kept) for each speculative step."""
    from trio_mlx.actor._speculate import MIN_MATCH, START_DRAFT, NgramIndex, RowSpec

    row, index = RowSpec(), NgramIndex(n)
    held, pos = [*prompt], 0  # out[pos] is the pending token
    while pos < len(out):
        index.extend(held[len(index) :])
        k = min(row.next_k(START_DRAFT, most), len(out) - pos - 1)
        gate = row.allowed(len(held)) and row.watch(index, min(MIN_MATCH, n))
        hits = sum(row.guesses)
        if gate and row.guess is not None and k > 0:
            known = row.known_at(len(held))
            drafts = row.drafts(index, k)
            kept = 0
            if known is not None or row.guess == out[pos]:
                for i, t in enumerate(drafts):
                    if pos + 1 + i >= len(out) or out[pos + 1 + i] != t:
                        break
                    kept = i + 1
            held += out[pos : pos + 1 + kept]
            pos += 1 + kept
            row.record(len(drafts), kept, len(held))
            if pos < len(out):
                row.known = (len(held), out[pos])
            steps.append((hits, len(drafts), kept))
        else:
            held.append(out[pos])
            pos += 1


def report(data: dict[str, list[list[int]]]) -> None:
    steps: list[tuple[int, int, int]] = []
    for p, o in zip(data["prompts"], data["outs"], strict=True):
        replay(p, o, steps)
    tokens = sum(len(o) for o in data["outs"])
    by: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for hits, drafted, kept in steps:
        by[hits].append((drafted, kept))
    print(f"{len(data['outs'])} answers, {tokens} tokens, {len(steps)} speculative steps, "
          f"{sum(k for _, _, k in steps)} drafts kept of {sum(d for _, d, _ in steps)}")
    print("hits\tsteps\tkept 0\tmean kept\tmean drafted")
    for hits in sorted(by):
        v = by[hits]
        print(f"{hits}\t{len(v)}\t{sum(1 for _, k in v if k == 0)}\t{sum(k for _, k in v) / len(v):.2f}"
              f"\t{sum(d for d, _ in v) / len(v):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--out")
    ap.add_argument("--replay")
    ap.add_argument("--first", type=int, default=24)
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    a = ap.parse_args()
    if a.replay:
        with (gzip.open if a.replay.endswith(".gz") else open)(a.replay, "rt") as f:
            data = json.load(f)
    elif a.model:
        data = trio.run(answers, a.model, a.first, a.count, a.tokens, a.prompt_tokens)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(data, f)
    else:
        sys.exit("a model to ask, or --replay")
    report(data)


if __name__ == "__main__":
    main()
