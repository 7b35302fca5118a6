"""Probe: what the quantized KV cache (`kv_bits`) does to greedy tokens, against the model's own KV.

    PYTHONPATH=. python benchmarks/probes/probe_kv_quality.py [--model M] [--configs none,8/64,4/64,4/32]
        [--max-tokens 160] [--chars 1400] [--out F.json]

Run from the repository root (the prompts are passages of this repository's docs). Eight
chat prompts of a few hundred tokens (a passage, then a question about it or a request to
continue it), greedy, through the engine (`trio_mlx.open_engine`; default model: the
embedded SmolLM2-135M-Instruct, real weights), all eight at once, one engine per
configuration: none (the model's own KV: float32 on the CPU), and kv_bits/kv_group_size.
For each quantized configuration and prompt: how many answer tokens equal the reference's
before the first that differs (as a fraction of the reference's length), and how many equal
it position by position over the whole answer. Prints one JSON line per configuration and
a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import trio

import trio_mlx

QUESTIONS = [
    "Summarize the passage above in five sentences.",
    "Continue the passage above for another paragraph, in the same style.",
    "List every module the passage above names, one per line, each with what it is for.",
    "Explain the passage above to a new contributor, step by step.",
]


def prompts(chars: int) -> list[str]:
    sources = ["docs/design.md", "docs/server.md", "README.md", "docs/engine.md"]
    out = []
    for i in range(8):
        text = Path(sources[i % len(sources)]).read_text()
        start = (i // len(sources) + 1) * 3 * chars % max(1, len(text) - chars)
        out.append(text[start : start + chars] + "\n\n" + QUESTIONS[i % len(QUESTIONS)])
    return out


async def answers(model: str | None, knobs: dict, texts: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    got: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    async with trio_mlx.open_engine(model, max_batch=8, **knobs) as engine:

        async def one(i: int) -> None:
            ids: list[int] = []
            async with engine.chat([{"role": "user", "content": texts[i]}], max_tokens=max_tokens,
                                   temperature=0.0, ignore_eos=True) as events:
                async for ev in events:
                    if isinstance(ev, trio_mlx.TextDelta):
                        ids.extend(ev.token_ids)
                    elif isinstance(ev, trio_mlx.Finished):
                        lengths[i] = ev.usage.prompt_tokens
            got[i] = ids

        async with trio.open_nursery() as nursery:
            for i in range(len(texts)):
                nursery.start_soon(one, i)
    return [got[i] for i in range(len(texts))], [lengths[i] for i in range(len(texts))]


def agreement(ref: list[int], other: list[int]) -> tuple[float, float]:
    """(identical tokens before the first divergence, identical tokens position by position),
    each as a fraction of the reference's length."""
    first = next((i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b), min(len(ref), len(other)))
    same = sum(a == b for a, b in zip(ref, other, strict=False))
    return first / len(ref), same / len(ref)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--configs", default="none,8/64,4/64,4/32")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--chars", type=int, default=1400)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    texts = prompts(a.chars)
    results: dict[str, list[list[int]]] = {}
    rows = []
    for name in a.configs.split(","):
        knobs = {} if name == "none" else dict(zip(("kv_bits", "kv_group_size"), map(int, name.split("/")), strict=True))
        results[name], prompt_tokens = await answers(a.model, knobs, texts, a.max_tokens)
        row: dict = {"config": name, "prompt_tokens": prompt_tokens}
        if name != "none":
            pairs = [agreement(r, o) for r, o in zip(results["none"], results[name], strict=True)]
            row |= {"until_divergence": [round(x, 3) for x, _ in pairs], "identical": [round(y, 3) for _, y in pairs],
                    "until_divergence_mean": statistics.mean(x for x, _ in pairs),
                    "identical_mean": statistics.mean(y for _, y in pairs),
                    "whole_answers_equal": sum(x == 1.0 for x, _ in pairs)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "tokens": results}, indent=1))  # noqa: ASYNC240 - once


trio.run(main)
