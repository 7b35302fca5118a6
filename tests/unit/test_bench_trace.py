"""`trio-mlx bench trace`: the report of a small synthetic step trace (a server's, gzipped, with
its request trace beside, and a ceiling's), figure by figure, worked out by hand below."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from trio_mlx.bench import _cli as _bench

HEADER = "t\texchange_s\tnext_s\tinserted\tgenerated\tprompt_tokens\tlive\tretired\trows\tcpu_s\n"

# (t, exchange_s, next_s, inserted, generated, prompt_tokens, live, retired, rows, cpu_s)
SERVER = [
    (0.000, 0.000, 0.040, 8, 8, 800, 8, 0, 8, 0.030),  # r0 prefill
    (0.050, 0.002, 0.010, 0, 8, 0, 8, 0, 8, 0.009),  # r1 decode, c=8
    (0.070, 0.003, 0.012, 0, 8, 0, 8, 0, 8, 0.010),  # r2 decode, c=8
    (0.090, 0.001, 0.020, 0, 8, 0, 8, 0, 8, 0.011),  # r3 decode, c=8
    (0.120, 0.002, 0.011, 0, 8, 0, 8, 2, 8, 0.010),  # r4 removal (and a plain decode step, c=8)
    None,  # a second run appended to the same file: its header again
    (2.000, 0.001, 0.050, 24, 30, 0, 30, 0, 30, 0.040),  # r5 insert, after an idle gap
    (2.060, 0.004, 0.030, 0, 30, 0, 30, 0, 30, 0.020),  # r6 decode, c=32
    (2.100, 0.004, 0.031, 0, 30, 0, 30, 0, 30, 0.020),  # r7 decode, c=32
    (2.140, 0.006, 0.032, 0, 30, 0, 30, 0, 30, 0.020),  # r8 decode, c=32
    (2.180, 0.004, 0.099, 0, 20, 0, 20, 0, 20, 0.050),  # r9 decode, 20 of 32 rows: no c=32 figure
    (2.290, 0.001, 0.000, 0, 0, 0, 0, 0, 0, 0.000),  # r10 an idle actor's empty turn
]
CEILING = [
    (0.000, 0.0, 0.005, 0, 8, 0, 8, 0, 8, 0.005),
    (0.010, 0.0, 0.006, 0, 8, 0, 8, 0, 8, 0.006),
    (0.020, 0.0, 0.007, 0, 8, 0, 8, 0, 8, 0.007),
    (0.030, 0.0, 0.020, 0, 32, 0, 32, 0, 32, 0.020),
]
REQUESTS = (
    "arrived\tintake_s\tttft_s\te2e_s\tprompt_tokens\tcached_tokens\tcompletion_tokens\t"
    "endpoint\toutcome\trequest_id\n"
    "10.000000\t0.002000\t0.1\t0.500000\t8\t0\t8\tcompletions\tok\ta\n"
    "10.600000\t0.004000\t0.1\t0.300000\t8\t0\t8\tcompletions\tok\tb\n"  # 100 ms after a's end
    "12.000000\t0.010000\t0.1\t0.200000\t8\t0\t8\tcompletions\tok\tc\n"  # 1.1 s after b's: no gap
    "12.100000\t\t\t\t8\t0\t0\tcompletions\tdisconnect\td\n"  # never admitted: left out
)


def _lines(rows: list[tuple[float, ...] | None]) -> str:
    return HEADER + "".join(HEADER if r is None else "\t".join(map(str, r)) + "\n" for r in rows)


@pytest.fixture
def traces(tmp_path: Path) -> tuple[Path, Path]:
    server = tmp_path / "server.tsv.gz"
    with gzip.open(server, "wt") as f:
        f.write(_lines(SERVER))
    (tmp_path / "server.tsv.requests").write_text(REQUESTS)
    ceiling = tmp_path / "ceiling.tsv"
    ceiling.write_text(_lines(CEILING))
    return server, ceiling


def test_trace_reports_each_level_beside_the_ceiling(
    traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, ceiling = traces
    assert _bench.main(["trace", str(server), str(ceiling)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        # decode p50: median of r1-r4 (10, 12, 20, 11 ms); the ceiling's 5, 6, 7: 6, 11.5 / 6 = 1.92.
        # The loop's turns r1>r2, r2>r3, r3>r4 (r4>r5 idles past 1 s): periods 20, 20, 30 ms,
        # the next step's exchange 3, 1, 2 and CPU 10, 11, 10. Own work (the gap less next()
        # and the exchange): 7, 7, 8 ms after r1, r2, r3; r4's gap is idle.
        "c=8: decode p50 11.50 ms (ceiling 6.00, x1.92); period p50 20.00; exchange p50 2.00; "
        "cpu p50 10.00; other: 3 steps, p50 7.00 ms, 0.02 s",
        # r6-r8 (30, 31, 32 ms; r9's 20 rows are too few for c=32); the ceiling's 20 ms.
        # Turns r6>r7>r8>r9: 40 ms each, exchanges 4, 6, 4, CPU 20, 20, 50. Own work: r5
        # follows r4's retired rows and inserts (removal, 60 - 50 - 4 = 6 ms); r6-r9 the
        # rest (6, 3, 4, 10 ms: median 5, 23 ms in all).
        "c=32: decode p50 31.00 ms (ceiling 20.00, x1.55); period p50 40.00; exchange p50 4.00; "
        "cpu p50 20.00; other: 4 steps, p50 5.00 ms, 0.02 s; removal: 1 steps, p50 6.00 ms, 0.01 s",
        # decode r1-r3, r6-r9: 0.234 s of 0.335 s, cpu 0.14; insert r5, prefill r0, removal r4;
        # r10 (nothing generated nor prefilled) is no step
        "steps by kind: decode 7 steps, 0.23 s (70%), mean 33.4 ms, cpu 0.14 s; "
        "insert 1 steps, 0.05 s (15%), mean 50.0 ms, cpu 0.04 s; "
        "prefill 1 steps, 0.04 s (12%), mean 40.0 ms, cpu 0.03 s; "
        "removal 1 steps, 0.01 s (3%), mean 11.0 ms, cpu 0.01 s",
        # intake 2, 4, 10 ms; b came back 100 ms after a ended, c 1.1 s after b (not counted)
        "requests: 3; intake p50 4.0 ms, max 10.0; return gap p50 100.0 ms, max 100.0 (1 requests)",
    ]


def test_trace_without_a_ceiling_or_request_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = tmp_path / "server.tsv"
    server.write_text(_lines(SERVER))
    assert _bench.main(["trace", str(server)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("c=8: decode p50 11.50 ms; period p50 20.00;")
    assert lines[1].startswith("c=32: decode p50 31.00 ms; period p50 40.00;")
    assert lines[2].startswith("steps by kind: decode 7 steps")


def test_trace_of_a_missing_file_or_column_says_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read the trace"):
        _bench.main(["trace", str(tmp_path / "nothing.tsv")])
    old = tmp_path / "old.tsv"  # the columns before `retired` came
    old.write_text("t\texchange_s\tnext_s\tinserted\tgenerated\tprompt_tokens\tlive\n"
                   "0.0\t0.0\t0.01\t0\t8\t0\t8\n")
    with pytest.raises(SystemExit, match="no column 'retired'"):
        _bench.main(["trace", str(old)])


def test_the_step_trace_gives_each_steps_drafted_tokens(tmp_path):
    """A speculative step's line counts the tokens drafted in it (every row's), a plain step's
    0: what tells the two apart, a kept draft's tokens being in `generated` either way."""
    from types import SimpleNamespace

    from trio_mlx.actor._trace import StepTrace

    trace = StepTrace(str(tmp_path / "t.tsv"))
    plain = SimpleNamespace(step_seconds=0.01, tokens=[1, 2], prompt_tokens=0, live=2, speculated=())
    spec = SimpleNamespace(step_seconds=0.02, tokens=[1, 2, 3, 4], prompt_tokens=0, live=2,
                           speculated=((7, 4, 2), (8, 3, 0)))
    trace.write(1.0, 0.0, plain, 0, 0, 2)  # type: ignore[arg-type]
    trace.write(2.0, 0.0, spec, 0, 0, 2)  # type: ignore[arg-type]
    trace.close()
    header, *lines = (tmp_path / "t.tsv").read_text().splitlines()
    rows = [dict(zip(header.split("\t"), line.split("\t"), strict=True)) for line in lines]
    assert [(r["generated"], r["drafted"]) for r in rows] == [("2", "0"), ("4", "7")]


def test_trace_counts_a_dry_batch_s_settle_as_a_kind_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace with `settle_s`: the line of a dry batch's rows leaving after the report (no
    tokens, a wait for the device) is a `settle`; an idle turn (no wait) is still no step."""
    server = tmp_path / "server.tsv"
    header = HEADER.rstrip("\n") + "\tdrafted\tsettle_s\n"
    rows = [(*r, 0, 0.0) for r in SERVER if r is not None]
    rows.insert(5, (0.140, 0.0, 0.015, 0, 0, 0, 0, 0, 0, 0.010, 0, 0.004))  # after r4: the settle
    server.write_text(header + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    assert _bench.main(["trace", str(server)]) == 0
    kinds = capsys.readouterr().out.splitlines()[2]
    assert kinds.endswith("; settle 1 steps, 0.01 s (4%), mean 15.0 ms, cpu 0.01 s"), kinds


def test_a_settle_line_is_left_out_of_the_next_lines_exchange(tmp_path):
    """The settle runs after the step's report went over, inside the wait the next line calls
    its exchange: that line's exchange leaves the settle out, once."""
    from types import SimpleNamespace

    from trio_mlx.actor._trace import StepTrace

    trace = StepTrace(str(tmp_path / "t.tsv"))
    step = SimpleNamespace(step_seconds=0.01, tokens=[1], prompt_tokens=0, live=0, speculated=())
    trace.write(1.0, 0.001, step, 0, 0, 1)  # type: ignore[arg-type]
    trace.settle_row(1.02, 0.25, 0, 0, 0.1)
    trace.write(1.5, 0.7, step, 1, 0, 1)  # type: ignore[arg-type]
    trace.write(1.6, 0.002, step, 0, 0, 1)  # type: ignore[arg-type]
    trace.close()
    header, *lines = (tmp_path / "t.tsv").read_text().splitlines()
    rows = [dict(zip(header.split("\t"), line.split("\t"), strict=True)) for line in lines]
    assert [(r["exchange_s"], r["next_s"], r["settle_s"]) for r in rows] == [
        ("0.001000", "0.010000", "0.000000"), ("0.000000", "0.250000", "0.100000"),
        ("0.450000", "0.010000", "0.000000"), ("0.002000", "0.010000", "0.000000")]
