"""Replay: prompt lookup's speculative steps on the edit workload's answer, for a policy of
drafts a step, with the actor's own `NgramIndex` and `RowSpec`, costed at a plain step of
6.2 ms and a speculative one of 9, 13 or 19 ms (the README's table).

    PYTHONPATH=. python benchmarks/2026-11-30-h200/adaptive-drafts/replay.py

Greedy decoding gives the same answer whatever is drafted, so the engine is asked once
(speculation off) and every policy is replayed over its tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

import trio_mlx
from trio_mlx.actor._speculate import NgramIndex, RowSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "probes"))
from probe_speculative import EDIT  # noqa: E402

PROMPT = EDIT.format(src=(Path(__file__).resolve().parents[2] / "probes" / "edit_passage.txt").read_text())


async def answer() -> tuple[list[int], list[int]]:
    async with trio_mlx.open_engine(None) as engine:
        out: list[int] = []
        async with engine.chat([{"role": "user", "content": PROMPT}], max_tokens=300, temperature=0.0) as events:
            async for ev in events:
                if isinstance(ev, trio_mlx.TextDelta):
                    out += list(ev.token_ids)
    from transformers import AutoTokenizer

    model = sorted(Path.home().glob(".cache/trio_mlx/smollm2-135m-instruct-*"))[0]
    ids = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids), out


def replay(prompt: list[int], out: list[int], start: int, most: int, grow: bool, spec_ms: float,
           plain_ms: float = 6.2) -> tuple[float, int, int, int]:
    """(ms, speculative steps, drafts kept, drafted) over the answer."""
    row, index = RowSpec(), NgramIndex(8)
    held, pos, ms, steps, kept, drafted = [*prompt, out[0]], 1, 0.0, 0, 0, 0
    while pos < len(out):
        index.extend(held[len(index):])
        k = min(row.next_k(start, most) if grow else most, len(out) - pos - 1)
        if row.allowed(len(held)) and row.watch(index, 2) and row.guess is not None and k > 0:
            drafts = row.drafts(index, k)
            a = 0
            for i, t in enumerate(drafts if row.guess == out[pos] else []):
                if out[pos + 1 + i] != t:
                    break
                a = i + 1
            held += out[pos : pos + 1 + a]
            pos += 1 + a
            row.record(len(drafts), a, len(held))
            ms, steps, kept, drafted = ms + spec_ms, steps + 1, kept + a, drafted + len(drafts)
        else:
            held.append(out[pos])
            pos, ms = pos + 1, ms + plain_ms
    return ms, steps, kept, drafted


def main() -> None:
    prompt, out = trio.run(answer)
    off = 6.2 * (len(out) - 1)
    for name, start, most, grow in (("8 throughout", 8, 8, False), ("16 throughout", 16, 16, False),
                                    ("32 throughout", 32, 32, False), ("8 to 32", 8, 32, True),
                                    ("16 to 32", 16, 32, True), ("16 to 64", 16, 64, True)):
        cells = []
        for spec_ms in (9.0, 13.0, 19.0):
            ms, steps, kept, drafted = replay(prompt, out, start, most, grow, spec_ms)
            cells.append(f"{off / ms:.2f}")
        print(f"{name:14s} steps {steps:3d}  kept {kept} of {drafted}  x off at 9/13/19 ms: {' / '.join(cells)}")


if __name__ == "__main__":
    main()
