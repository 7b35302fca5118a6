"""Time rows speculating side by side with a draft model (judges off): the actor's own steps.

    PYTHONPATH=. python draftbatch.py TARGET_DIR DRAFT_DIR ROWS
"""

import statistics
import sys
import time
from pathlib import Path

from trio_mlx.actor import ActorConfig, ActorTuning, SamplingParams, Submit
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._decode import Decoder

Decoder.plain_step = lambda self, width: None  # type: ignore[method-assign]
if hasattr(Decoder, "wants_plain"):
    Decoder.wants_plain = lambda self, width: False  # type: ignore[method-assign]


class Link:
    def built(self) -> None:
        pass


def run(target: Path, draft: str, rows: int) -> tuple[float, int]:
    tuning = ActorTuning(warmup=False, admit_window=0.0, draft_model=draft, num_draft_tokens=3)
    actor = Actor(ActorConfig(model_path=target, tuning=tuning), link=Link())  # type: ignore[arg-type]
    actor._load()
    subs = [Submit(i + 1, tuple(range(5 + i, 100 + i)), 120, SamplingParams(temperature=0.0), frozenset())
            for i in range(rows)]
    actor._step(actor._apply(subs) or [])
    t0, tokens, steps = time.perf_counter(), 0, 0
    while actor.schedule.seqs and steps < 500:
        tokens += len(actor._step([]).tokens)
        steps += 1
    return tokens / (time.perf_counter() - t0), steps


if __name__ == "__main__":
    target, draft, rows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    out = [run(target, draft, rows) for _ in range(3)]
    print(f"rows={rows} tok/s {statistics.median(t for t, _ in out):.0f} steps {out[0][1]}")
