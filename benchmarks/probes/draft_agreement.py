"""Probe: how often a draft model agrees with its target on ordinary chat prompts, greedy.

    PYTHONPATH=. python benchmarks/probes/draft_agreement.py --target T --draft D
        [--mode forced,engine] [--k 3,4,5] [--max-tokens 96] [--prompts 8] [--out F.json]
        [--random N --prompt-tokens L --ignore-eos]

For tuning a constructed target (`grow_target.py`) against its draft, and for reading the
acceptance a benchmark of that pair should see. Two measures, on the same chat prompts:

- `forced` (mlx-lm, no engine): the target answers each prompt greedily; the draft then
  reads the prompt and that answer in one forward, and at each answer position its argmax is
  compared with the target's token. Per-token agreement is the fraction equal; from the same
  match sequence, the acceptance greedy speculation with K drafts a step would have (each
  step drafts K, keeps the run of matches from where it stands up to K, then takes the
  target's token) is computed for every `--k`, with the tokens each step yields.
- `engine`: trio_mlx's engine with `draft_model=D`, `num_draft_tokens=K` serves the
  prompts one at a time (c=1, greedy), and the acceptance is its own `usage` counters'
  (accepted / drafted) over all of them; the first answers are printed, to see that the
  target's text is still coherent.

`--random N --prompt-tokens L --ignore-eos` measures the same on what `trio-mlx bench
--endpoint chat` sends instead (random token text in a user message, answers that run to
`--max-tokens`): the acceptance a bench of the pair should see.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import trio_mlx.models  # noqa: F401 - before mlx.core: on a Linux CPU it puts OpenBLAS under MLX

PROMPTS = [
    "What is the capital of France? Answer in one sentence, then tell me one fact about it.",
    "Write a short poem about the sea.",
    "Explain what a binary search is, step by step.",
    "Give me three tips for sleeping better.",
    "What is photosynthesis? Explain it to a ten-year-old.",
    "Write a Python function that reverses a string, and explain it.",
    "Summarize the story of Little Red Riding Hood in a few sentences.",
    "What are the main differences between a cat and a dog as pets?",
    "How do I make a cup of tea?",
    "Describe the water cycle.",
    "List five fruits and say what colour each one is.",
    "Why is the sky blue?",
]


def simulate(matches: list[bool], k: int) -> tuple[int, int, int]:
    """(drafted, accepted, steps) of greedy speculation with `k` drafts a step over a match
    sequence: matches[t] says whether the draft's argmax after the target's first t answer
    tokens is the target's token t."""
    drafted = accepted = steps = 0
    t, n = 0, len(matches)
    while t < n:
        kk = min(k, n - t)
        a = 0
        while a < kk and matches[t + a]:
            a += 1
        drafted += kk
        accepted += a
        steps += 1
        t += a + 1  # the kept drafts and the target's own token
    return drafted, accepted, steps


def greedy(model, ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """The model's greedy answer to `ids`: up to `max_tokens` tokens, ending at a `stop` id
    (not included); none stops it when `stop` is empty (as `ignore_eos` serves)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)
    out: list[int] = []
    for _ in range(max_tokens):
        t = int(mx.argmax(logits[0, -1]).item())
        if t in stop:
            break
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return out


def forced(target: str, draft: str, prompts: list[str], max_tokens: int, ks: list[int],
           ignore_eos: bool = False) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    tm, tok = load(target)
    dm, _ = load(draft)
    stop = set() if ignore_eos else set(getattr(tok, "eos_token_ids", None) or {tok.eos_token_id})
    matches_all: list[list[bool]] = []
    texts = []
    for p in prompts:
        ids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        out = greedy(tm, ids, max_tokens, stop)
        texts.append(tok.decode(out))
        if not out:
            matches_all.append([])
            continue
        seq = mx.array(ids + out)[None]
        logits = dm(seq)[0, len(ids) - 1: len(ids) - 1 + len(out)]
        pred = mx.argmax(logits, axis=-1).tolist()
        matches_all.append([a == b for a, b in zip(pred, out, strict=True)])
    flat = [m for ms in matches_all for m in ms]
    res: dict = {"tokens": len(flat), "agreement": sum(flat) / max(1, len(flat)),
                 "per_prompt": [sum(ms) / max(1, len(ms)) for ms in matches_all], "texts": texts}
    for k in ks:
        d = a = s = 0
        for ms in matches_all:
            dd, aa, ss = simulate(ms, k)
            d, a, s = d + dd, a + aa, s + ss
        res[f"k{k}"] = {"acceptance": a / max(1, d), "tokens_per_step": len(flat) / max(1, s)}
    return res


def engine(target: str, draft: str, prompts: list[str], max_tokens: int, k: int, ignore_eos: bool = False) -> dict:
    import trio

    import trio_mlx

    async def run() -> dict:
        drafted = accepted = tokens = 0
        texts = []
        t0 = time.perf_counter()
        async with trio_mlx.open_engine(target, draft_model=draft, num_draft_tokens=k) as eng:
            for p in prompts:
                text = ""
                async with eng.chat([{"role": "user", "content": p}], max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=ignore_eos) as events:
                    async for ev in events:
                        if isinstance(ev, trio_mlx.TextDelta):
                            text += ev.text
                        elif isinstance(ev, trio_mlx.Finished):
                            u = ev.usage
                            drafted += u.draft_tokens
                            accepted += u.accepted_draft_tokens
                            tokens += u.completion_tokens
                texts.append(text)
        return {"k": k, "drafted": drafted, "accepted": accepted, "tokens": tokens,
                "acceptance": accepted / drafted if drafted else None, "seconds": time.perf_counter() - t0,
                "texts": texts}

    return trio.run(run)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--mode", default="forced", help="forced, engine, or both comma-separated")
    p.add_argument("--k", default="3,4,5", help="drafts a step (forced: each simulated; engine: each run)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=8, help=f"how many of the {len(PROMPTS)} built-in prompts")
    p.add_argument("--random", type=int, default=0,
                   help="instead: this many random prompts as `trio-mlx bench --endpoint chat` makes them")
    p.add_argument("--prompt-tokens", type=int, default=128, help="with --random: their length")
    p.add_argument("--ignore-eos", action="store_true", help="answers run to --max-tokens (as the bench's)")
    p.add_argument("--show", type=int, default=2, help="answers to print (coherence)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    prompts = PROMPTS[: a.prompts]
    if a.random:
        from trio_mlx.bench._prompts import load_tokenizer, make_prompts

        prompts = [x.text for x in make_prompts(load_tokenizer(a.target), a.random, a.prompt_tokens, chat=True)]
    ks = [int(x) for x in a.k.split(",")]
    result: dict = {"target": a.target, "draft": a.draft, "max_tokens": a.max_tokens, "prompts": len(prompts),
                    "random": a.random, "ignore_eos": a.ignore_eos}
    modes = a.mode.split(",")
    if "forced" in modes:
        r = forced(a.target, a.draft, prompts, a.max_tokens, ks, a.ignore_eos)
        result["forced"] = r
        print(f"forced: {r['tokens']} tokens, agreement {r['agreement']:.3f}; "
              + ", ".join(f"K={k} acceptance {r[f'k{k}']['acceptance']:.3f} "
                          f"tokens/step {r[f'k{k}']['tokens_per_step']:.2f}" for k in ks), flush=True)
        for t in r["texts"][: a.show]:
            print("  target:", json.dumps(t[:300]))
    if "engine" in modes:
        result["engine"] = []
        for k in ks:
            r = engine(a.target, a.draft, prompts, a.max_tokens, k, a.ignore_eos)
            result["engine"].append(r)
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
            print(f"engine K={k}: drafted {r['drafted']} accepted {r['accepted']} acceptance {acc} "
                  f"({r['tokens']} tokens, {r['seconds']:.1f} s)", flush=True)
            for t in r["texts"][: a.show]:
                print("  target:", json.dumps(t[:300]))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
