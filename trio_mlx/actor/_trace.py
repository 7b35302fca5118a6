"""The step trace (TRIO_MLX_STEP_TRACE): one tab-separated line per actor step, a tool for
finding where a step's time goes. The ceiling of `trio-mlx bench --limit` writes the same columns."""

from __future__ import annotations

import time

from ._protocol import StepReport


class StepTrace:
    """One line per step: wall time, seconds waiting on the engine (the exchange),
    seconds in `BatchGenerator.next()`, sequences inserted this step, tokens
    generated, prompt tokens prefilled, live sequences, finished sequences
    whose rows are still in the batch (retired), the decoding batch's rows, the
    stepping thread's CPU seconds since the last line (beside the wall time, it tells
    a step that computed from one that waited: for the GPU, or for the GIL), the
    tokens drafted in the step (0: a plain step; `generated` counts the kept ones), and
    the seconds of `next_s` the step waited for the device to finish its queued work
    after the batch ran dry (before it reads MLX's memory figures; 0 in other steps).

    A single device's actor hands the report of a step that left the batch empty over
    before those rows leave (`Actor.settle`): that is a line of its own, after the step's,
    with no tokens, `next_s` the rows' leaving and the wait (`settle_s`) together, and left
    out of the next line's `exchange_s` (which it falls within)."""

    HEADER = ("t\texchange_s\tnext_s\tinserted\tgenerated\tprompt_tokens\tlive\tretired\trows\tcpu_s"
              "\tdrafted\tsettle_s\n")

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1 << 16)  # closed in close()
        self._f.write(self.HEADER)
        self._cpu: float | None = None  # the stepping thread's, from its first line on
        self._settling = 0.0  # the last settle line's seconds, out of the next line's exchange

    def write(self, t: float, exchange: float, report: StepReport, inserted: int, retired: int,
              rows: int, settle: float = 0.0) -> None:
        exchange, self._settling = max(0.0, exchange - self._settling), 0.0
        self.row(t, exchange, report.step_seconds, inserted, len(report.tokens), report.prompt_tokens,
                 report.live, retired, rows, sum(d for _, d, _ in report.speculated), settle)

    def row(self, t: float, exchange: float, next_s: float, inserted: int, generated: int,
            prompt_tokens: int, live: int, retired: int, rows: int, drafted: int = 0,
            settle: float = 0.0) -> None:
        """One line, whoever steps (the ceiling of `trio-mlx bench --limit` writes these too)."""
        now = time.thread_time()
        cpu, self._cpu = (now if self._cpu is None else self._cpu), now
        self._f.write(f"{t:.6f}\t{exchange:.6f}\t{next_s:.6f}\t{inserted}\t{generated}\t"
                      f"{prompt_tokens}\t{live}\t{retired}\t{rows}\t{now - cpu:.6f}\t{drafted}\t{settle:.6f}\n")

    def settle_row(self, t: float, seconds: float, live: int, rows: int, settle: float) -> None:
        """The line of a dry batch's rows leaving after its report went over (the class docstring)."""
        self._settling = seconds
        self.row(t, 0.0, seconds, 0, 0, 0, live, 0, rows, 0, settle)

    def close(self) -> None:
        self._f.close()

