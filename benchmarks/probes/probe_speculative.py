"""Probe: speculative decoding through the engine, on a workload that repeats its context.

    PYTHONPATH=. python benchmarks/probes/probe_speculative.py [--model M] [--draft D]
        [--rounds 3] [--configs off,ngram,draft] [--max-tokens 400] [--chars 3000]
        [--workload repeat|edit] [--levels 1,4] [--repeats 1] [--trace PREFIX] [--out F.json]

The workload: `repeat` asks the model to repeat `repeat_passage.txt` (beside this file);
`edit` hands it `edit_passage.txt` (2,000 characters of Python) and asks for the file
rewritten with one identifier renamed, as an agent's edit asks. For each
round and each configuration (off / `speculative="ngram"` / a draft model: `--draft`,
default the model itself, which keeps every draft), one engine at a time, in
alternating order: a greedy chat request at c=1 that asks the model (default: the
embedded SmolLM2-135M-Instruct, real weights) to repeat a passage of its context,
then the same at c=4 (four rows speculating in one batch, `speculative_max_rows`); each
level `--repeats` times in the engine, the median taken.
Prints per request decode tokens/s (completion tokens after the first over the time
after the first token), TTFT (and the first request's after the engine is ready: a
compile stall would show there), the acceptance rate from `usage`, and whether each
configuration's text equals the first one's; then the median speed-up over "off".

What there is to draft is what the model wrote, and a 135M model does not always copy:
it may loop on a line of its own instead. So each answer is also split into 20-character
pieces, counted as `copied` (found in the prompt), `looped` (not in the prompt, found
earlier in the answer) or new: prompt lookup drafts the first two well, and only a
`copied` answer is the workload the name promises.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import trio

import trio_mlx


def passage(chars: int) -> str:
    # a fixed text (the first 3,000 characters of actor/_speculate.py as the records of
    # benchmarks/2026-11-29-h200/speculative/batched/ quoted it), so that the workload stays
    # the same when the module changes: the model's answer, and so what there is to draft,
    # depends on every character of it (a later version of the module drew a 36-token answer)
    text = (Path(__file__).parent / "repeat_passage.txt").read_text()
    return text[:chars]


EDIT = ("Here is a Python file:\n\n```python\n{src}\n```\n\nRewrite this file with one change: rename "
        "`WidthJudge` to `BatchWidthJudge`. Output the whole file.")


def pieces(text: str, prompt: str, size: int = 20) -> dict[str, float]:
    """The answer's `size`-character pieces: the fraction found in the prompt (`copied`), and
    of the rest the fraction found earlier in the answer (`looped`)."""
    starts = range(0, max(0, len(text) - size), size)
    copied = looped = 0
    for i in starts:
        piece = text[i : i + size]
        if piece in prompt:
            copied += 1
        elif piece in text[:i]:
            looped += 1
    n = max(1, len(starts))
    return {"copied": copied / n, "looped": looped / n}


async def one(engine, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text = ""
    async with engine.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
                           ignore_eos=False) as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta):
                if first is None and ev.token_ids:
                    first = time.perf_counter()
                text += ev.text
            elif isinstance(ev, trio_mlx.Finished):
                end = time.perf_counter()
                u = ev.usage
                n = u.completion_tokens
                return {"ttft": (first or end) - t0, "decode_tps": (n - 1) / max(1e-9, end - (first or end)),
                        "tokens": n, "drafted": u.draft_tokens, "accepted": u.accepted_draft_tokens, "text": text}
    raise AssertionError("no Finished")


async def level(engine, prompt: str, max_tokens: int, c: int) -> list[dict]:
    out: list[dict] = []

    async def worker() -> None:
        out.append(await one(engine, prompt, max_tokens))

    async with trio.open_nursery() as n:
        for _ in range(c):
            n.start_soon(worker)
    return out


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="a draft model (default: the model itself: every draft kept)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chars", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--configs", default="off,ngram,draft")
    p.add_argument("--workload", choices=("repeat", "edit"), default="repeat")
    p.add_argument("--levels", default="1,4", help="concurrencies, each after the last")
    p.add_argument("--repeats", type=int, default=1, help="each level this many times in an engine")
    p.add_argument("--trace", default=None, help="step traces to PREFIX-CONFIG-rROUND.tsv")
    p.add_argument("--out", default="spec.json")
    a = p.parse_args()
    if a.workload == "edit":
        prompt = EDIT.format(src=(Path(__file__).parent / "edit_passage.txt").read_text())
    else:
        prompt = "Repeat the following text exactly, from its first line to its last:\n\n" + passage(a.chars)
    configs = {"off": {}, "ngram": {"speculative": "ngram"},
               "draft": {"draft_model": a.draft or a.model or "default"}}
    for name in a.configs.split(","):  # ngramK: prompt lookup drafting up to K tokens a step
        if name.startswith("ngram") and name[5:].isdigit():
            configs[name] = {"speculative": "ngram", "num_draft_tokens": int(name[5:])}
    levels = [int(c) for c in a.levels.split(",")]
    rows: list[dict] = []
    texts: dict[str, str] = {}
    for r in range(a.rounds):
        order = a.configs.split(",")
        if r % 2:
            order = order[::-1]  # paired rounds: A B C, C B A, ...
        for name in order:
            t0 = time.perf_counter()
            trace = {"step_trace": f"{a.trace}-{name}-r{r}.tsv"} if a.trace else {}
            async with trio_mlx.open_engine(a.model, **configs[name], **trace) as engine:
                load = time.perf_counter() - t0
                first = await one(engine, prompt, 16)  # the first request after ready (compile stalls?)
                for c in levels:
                    got = [g for _ in range(max(1, a.repeats)) for g in await level(engine, prompt, a.max_tokens, c)]
                    tps = statistics.median(g["decode_tps"] for g in got)
                    drafted = sum(g["drafted"] for g in got)
                    acc = sum(g["accepted"] for g in got)
                    row = {"round": r, "config": name, "c": c, "decode_tps": tps, "ttft_first_request": first["ttft"],
                           "ttft": statistics.median(g["ttft"] for g in got), "tokens": got[0]["tokens"],
                           "drafted": drafted, "accepted": acc, "acceptance": acc / drafted if drafted else None,
                           "load_s": load}
                    texts.setdefault(f"{c}", got[0]["text"])
                    row["same_text_as_first_config"] = got[0]["text"] == texts[f"{c}"]
                    row["text"] = got[0]["text"]
                    row.update(pieces(got[0]["text"], prompt))
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))  # noqa: ASYNC240 - once, after every level
    for c in levels:
        base = statistics.median(r["decode_tps"] for r in rows if r["config"] == "off" and r["c"] == c) if any(
            r["config"] == "off" for r in rows) else None
        for name in a.configs.split(","):
            tps = statistics.median(r["decode_tps"] for r in rows if r["config"] == name and r["c"] == c)
            accs = [r["acceptance"] for r in rows if r["config"] == name and r["c"] == c and r["acceptance"] is not None]
            first = next(r for r in rows if r["config"] == name and r["c"] == c)
            print(f"c={c} {name:6s} decode {tps:8.1f} tok/s" + (f"  x{tps / base:.2f} of off" if base else "")
                  + (f"  acceptance {statistics.median(accs):.2f}" if accs else "")
                  + f"  answer: {first['copied']:.0%} copied, {first['looped']:.0%} looped")


if __name__ == "__main__":
    trio.run(main)
