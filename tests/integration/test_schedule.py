"""The scheduler's rules (`actor/_schedule.py`): alone, with no MLX, and through both actors.

The first tests check `Schedule` itself in milliseconds. The rest run the same scripts
against `FakeActor` and the real `Actor` on the tiny fp32 model, each driven step by step
through its own `run()` by a link that plays a fixed command script: a sequence ends at
its max_tokens or its stop token, an abort applied between steps stops its tokens at
once, a Submit joins at the next step, and finished rows are retired by the same rule.
Whatever passes on the fake holds for the real actor, since both decide through the
schedule.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trio_mlx.actor import FakeActor
from trio_mlx.actor._protocol import (
    Abort,
    ActorConfig,
    ActorTuning,
    SamplingParams,
    Shutdown,
    StepReport,
    Submit,
    TokenOut,
)
from trio_mlx.actor._schedule import Schedule, Seq, finish_reason

GREEDY = SamplingParams(temperature=0.0)


def _sub(rid: int, max_tokens: int, stops: frozenset[int] = frozenset(), prompt: tuple[int, ...] = (5, 6, 7)) -> Submit:
    return Submit(rid, prompt, max_tokens, GREEDY, stops)


def _entered(schedule: Schedule, sub: Submit, uid: int, *, decoding: bool = True) -> Seq:
    seq = Seq.of(sub, uid)
    schedule.enter(seq)
    schedule.started(seq)
    if decoding:
        schedule.decodes(seq)
    return seq


# -- the module alone ----------------------------------------------------------------


def test_the_schedule_imports_no_mlx() -> None:
    code = ("import sys, trio_mlx.actor._schedule; "
            "sys.exit(1 if any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@dataclass
class _Grammar:
    """A constrained row's grammar as the finish rule sees it, its retirement noted."""

    error: str | None = None
    forced_finish: bool = False
    retired: bool = False

    def retire(self) -> None:
        self.retired = True


def test_an_ended_or_aborted_sequence_retires_its_grammar() -> None:
    """Its row may stay in the batch a few steps (retirement), but its grammar does no more
    work for tokens that are nobody's."""
    schedule = Schedule(retire_steps=16)
    ended, aborted, going = _Grammar(), _Grammar(), _Grammar()
    for rid, g in ((1, ended), (2, aborted), (3, going)):
        seq = Seq.of(_sub(rid, 4, frozenset({9})), rid, g)
        schedule.enter(seq)
        schedule.started(seq)
        schedule.decodes(seq)
    assert schedule.finish(schedule.seqs[1], 9) == "stop"
    assert schedule.abort(2) is not None
    assert schedule.finish(schedule.seqs[3], 4) is None
    assert (ended.retired, aborted.retired, going.retired) == (True, True, False)
    assert schedule.retired == {1: 0}  # the ended row still in the batch


def test_a_stop_token_ends_as_stop_even_at_max_tokens() -> None:
    assert finish_reason(9, 3, frozenset({9}), 3) == "stop"
    assert finish_reason(8, 3, frozenset({9}), 3) == "length"
    assert finish_reason(8, 2, frozenset({9}), 3) is None


def test_a_finished_sequence_leaves_the_table_and_its_row_is_retired() -> None:
    schedule = Schedule(retire_steps=4)
    a = _entered(schedule, _sub(1, 2), uid=10)
    _entered(schedule, _sub(2, 9), uid=11)
    assert schedule.decoding == 2 and not schedule.prefilling
    assert schedule.finish(a, 50) is None and a.generated == 1
    schedule.steps = 7
    assert schedule.finish(a, 50) == "length"
    assert 1 not in schedule.seqs and 10 not in schedule.by_uid and schedule.decoding == 1
    assert schedule.retired == {10: 7}


def test_a_row_the_generator_ended_is_not_retired() -> None:
    schedule = Schedule(retire_steps=4)
    a = _entered(schedule, _sub(1, 9), uid=10)
    assert schedule.finish(a, 50, "length") == "length" and not schedule.retired and not schedule.seqs


def test_a_grammar_fails_its_row_or_closes_it_at_max_tokens() -> None:
    schedule = Schedule(retire_steps=4)
    failed = _entered(schedule, _sub(1, 9, frozenset({2})), uid=10)
    failed.grammar = _Grammar(error="refused")
    assert schedule.finish(failed, 2) == "error"
    closed = _entered(schedule, _sub(2, 9, frozenset({2})), uid=11)
    closed.grammar = _Grammar(forced_finish=True)
    assert schedule.finish(closed, 2) == "length"
    ended = _entered(schedule, _sub(3, 9, frozenset({2})), uid=12)
    ended.grammar = _Grammar()
    assert schedule.finish(ended, 2) == "stop"


def test_an_abort_takes_the_sequence_out_at_any_stage() -> None:
    schedule = Schedule(retire_steps=4)
    queued = _entered(schedule, _sub(1, 9), uid=10, decoding=False)
    _entered(schedule, _sub(2, 9), uid=11)
    assert schedule.prefilling
    assert schedule.abort(1) is queued and schedule.decoding == 1 and not schedule.prefilling
    assert schedule.abort(2) is not None and schedule.decoding == 0 and not schedule.seqs
    assert schedule.abort(3) is None and not schedule.retired


def test_retired_rows_leave_together_when_the_batch_changes_or_the_oldest_waited_enough() -> None:
    schedule = Schedule(retire_steps=4)
    for rid in (1, 2):
        seq = _entered(schedule, _sub(rid, 1), uid=10 + rid)
        schedule.steps = rid
        schedule.finish(seq, 50)
    _entered(schedule, _sub(3, 99), uid=13)
    schedule.steps = 4
    assert schedule.leaving(False) == [] and not schedule.dry()
    assert schedule.leaving(True) == [11, 12] and not schedule.retired  # rows enter or leave anyway
    schedule.retired.update({11: 1, 12: 2})
    schedule.steps = 5
    assert schedule.leaving(False) == [11, 12]  # the oldest waited 4 steps
    schedule.retired.update({11: 5})
    _entered(schedule, _sub(4, 9), uid=14, decoding=False)
    assert schedule.leaving(False) == [11]  # a sequence waits to prefill: it needs the slots


def test_a_batch_that_runs_dry_lets_every_retired_row_go() -> None:
    schedule = Schedule(retire_steps=1000)
    seq = _entered(schedule, _sub(1, 1), uid=10)
    schedule.finish(seq, 50)
    assert schedule.dry() == [10] and not schedule.retired and schedule.dry() == []


def test_the_slack_past_max_tokens_stays_inside_the_context() -> None:
    assert Schedule(retire_steps=16).slack(10, 20, 1000) == 18
    assert Schedule(retire_steps=16).slack(10, 20, 35) == 5
    assert Schedule(retire_steps=16).slack(10, 40, 35) == 0
    assert Schedule(retire_steps=0).slack(10, 20, 1000) == 0


def test_the_schedule_forgets_every_sequence_but_keeps_its_clock() -> None:
    schedule = Schedule(retire_steps=4)
    seq = _entered(schedule, _sub(1, 1), uid=10)
    _entered(schedule, _sub(2, 9), uid=11)
    schedule.steps = 3
    schedule.finish(seq, 50)
    schedule.clear()
    assert not (schedule.seqs or schedule.by_uid or schedule.retired or schedule.decoding)
    assert schedule.steps == 3


# -- the same rules through the fake and the real actor -----------------------------


class _Driver:
    """An actor's link that plays `script[k]` in the exchange before step k, for `steps`
    steps, then shuts the actor down. It keeps every step's report, and the count of
    retired rows the actor's schedule holds after each step."""

    def __init__(self, script: dict[int, list[Any]], steps: int):
        self.script, self.steps = script, steps
        self.reports: list[StepReport] = []
        self.retired: list[int] = []
        self.actor: Any = None
        self._exchanges = 0

    def ready(self, info: Any) -> None:
        pass

    def check(self) -> None:
        pass

    def built(self) -> None:
        pass

    def exchange(self, report: StepReport) -> list[Any]:
        if self._exchanges:  # the first exchange carries no step's report
            self.reports.append(report)
            self.retired.append(len(self.actor.schedule.retired))
        k, self._exchanges = self._exchanges, self._exchanges + 1
        return [Shutdown()] if k >= self.steps else list(self.script.get(k, []))

    def wait_commands(self, timeout: float | None = None) -> list[Any]:
        return []  # idle: the loop goes round to the next exchange

    def tokens(self, rid: int) -> list[tuple[int, TokenOut]]:
        """(step, token) of every token `rid` made."""
        return [(k, t) for k, r in enumerate(self.reports) for t in r.tokens if t.rid == rid]


@pytest.fixture(params=["fake", "real"])
def serve(request: pytest.FixtureRequest, tiny_model_fp32: Path) -> Any:
    """Run `script` through a fresh actor of either kind for `steps` steps; the driver."""

    def serve(script: dict[int, list[Any]], steps: int, **config: Any) -> _Driver:
        link = _Driver(script, steps)
        cfg = ActorConfig(model_path=tiny_model_fp32, tuning=ActorTuning(warmup=False, admit_window=0.0, **config))
        if request.param == "fake":
            actor: Any = FakeActor(cfg, link)
        else:
            from trio_mlx.actor._actor import Actor

            actor = Actor(cfg, link)
        link.actor = actor
        actor.run()
        assert not any(r.failed for r in link.reports)
        return link

    return serve


def test_a_sequence_ends_at_its_max_tokens(serve: Any) -> None:
    run = serve({0: [_sub(1, 5, prompt=(5, 6, 7, 8))]}, 10)
    tokens = run.tokens(1)
    assert [t.finish_reason for _, t in tokens] == [None] * 4 + ["length"]


def test_a_sequence_ends_at_its_stop_token_even_the_last_one_allowed(serve: Any) -> None:
    free = [t.token for _, t in serve({0: [_sub(1, 8, prompt=(9, 10, 11))]}, 12).tokens(1)]
    assert len(free) == 8
    i = next((i for i in range(1, 8) if free[i] not in free[:i]), 0)  # its first occurrence
    stops = frozenset({free[i]})
    stopped = serve({0: [_sub(1, 8, stops, prompt=(9, 10, 11)), _sub(2, i + 1, stops, prompt=(9, 10, 11))]}, 12)
    for rid in (1, 2):
        tokens = stopped.tokens(rid)
        assert [t.token for _, t in tokens] == free[: i + 1]
        assert [t.finish_reason for _, t in tokens] == [None] * i + ["stop"]


def test_an_abort_between_steps_stops_the_sequences_tokens_at_once(serve: Any) -> None:
    run = serve({0: [_sub(1, 40, prompt=(5, 6, 7)), _sub(2, 12, prompt=(20, 21))], 5: [Abort(1)]}, 16)
    aborted = run.tokens(1)
    assert aborted and max(k for k, _ in aborted) == 4  # it made a token the step before
    assert all(t.finish_reason is None for _, t in aborted)
    kept = run.tokens(2)
    assert [t.finish_reason for _, t in kept] == [None] * 11 + ["length"]
    assert any(k >= 5 for k, _ in kept)
    assert not run.actor.schedule.seqs and not run.actor.schedule.retired


def test_a_submit_joins_at_the_next_step(serve: Any) -> None:
    run = serve({0: [_sub(1, 30, prompt=(5, 6, 7))], 4: [_sub(2, 3, prompt=(40, 41, 42, 43))]}, 40)
    assert [k for k, r in enumerate(run.reports) if 2 in r.prefilling] == [4]
    assert [t.finish_reason for _, t in run.tokens(2)] == [None, None, "length"]
    assert min(k for k, _ in run.tokens(2)) >= 4
    assert len(run.tokens(1)) == 30


def test_finished_rows_are_retired_until_the_oldest_waited_retire_steps(serve: Any) -> None:
    run = serve({0: [_sub(1, 3, prompt=(5, 6, 7)), _sub(2, 20, prompt=(30, 31))]}, 30, retire_steps=4)
    done = run.tokens(1)[-1][0]
    assert run.retired[done: done + 5] == [1, 1, 1, 1, 0]
    assert len(run.tokens(1)) == 3 and len(run.tokens(2)) == 20  # no retired row's token leaked


def test_finished_rows_leave_when_a_submit_joins_and_when_the_batch_runs_dry(serve: Any) -> None:
    run = serve({0: [_sub(1, 3, prompt=(5, 6, 7)), _sub(2, 16, prompt=(30, 31))], 8: [_sub(3, 2, prompt=(50, 51))]},
                30, retire_steps=1000)
    done = run.tokens(1)[-1][0]
    assert done < 7 and run.retired[done:8] == [1] * (8 - done) and run.retired[8] == 0
    last = max(k for rid in (2, 3) for k, _ in run.tokens(rid))
    assert run.retired[last] == 0  # the last live sequence finished: every retired row left with it
    assert [len(run.tokens(rid)) for rid in (1, 2, 3)] == [3, 16, 2]
