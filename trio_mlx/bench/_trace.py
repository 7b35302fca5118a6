"""`trio-mlx bench trace`: read step traces (TRIO_MLX_STEP_TRACE / TRIO_MLX_CEILING_TRACE) level by level.

    trio-mlx bench trace SERVER_TRACE [CEILING_TRACE]

Each row of a trace is one step of the actor (or of the ceiling of `trio-mlx bench
--limit`, in the same columns); the columns are read by the names of the trace's own
header line. Per concurrency level (a steady decode step's row count, rounded up to
1/8/32/64/128/256), prints for the server: the median decode step, its loop's period,
exchange and CPU (the turn from one decode step to the next), the time between steps
spent outside `next()` and the exchange (the actor's own work: inserting, removing
rows), split into steps that removed rows and the rest; and, given the ceiling's trace,
its median decode step at the same level. A server whose decode steps run slower than
the ceiling's at the same level lost to the host, not to its scheduling. Then every
step's time by kind (prefill, insert, removal, decode, a dry batch's settle), whatever its level; and, where
the server wrote its request trace beside (SERVER_TRACE.requests), its requests' intake
and the gap from one request's end to the next arrival. Traces may be gzipped.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import statistics
import sys

LEVELS = (1, 8, 32, 64, 128, 256)
# the columns read here, by the names of the trace's own header line (the actor's StepTrace)
T, EXCHANGE, NEXT, INSERTED, GENERATED, PROMPT, LIVE, RETIRED, CPU = (
    "t", "exchange_s", "next_s", "inserted", "generated", "prompt_tokens", "live", "retired", "cpu_s")  # fmt: skip
SETTLE = "settle_s"  # a column later traces have (read where present)


def rows(path: str) -> list[dict[str, str]]:
    """The lines of a tab-separated trace, one dict per line keyed by its header; a trace
    appended to by several runs repeats the header, which is skipped."""
    f = gzip.open(path, "rt") if path.endswith(".gz") else open(path)  # noqa: SIM115
    with f:
        header = next(f).rstrip("\n").split("\t")
        return [dict(zip(header, line.rstrip("\n").split("\t"), strict=True))
                for line in f if not line.startswith(header[0] + "\t")]  # fmt: skip


def load(path: str) -> list[dict[str, float]]:
    """The steps of a step trace (`rows`), as numbers."""
    return [{k: float(v) for k, v in r.items()} for r in rows(path)]


def level(n: float) -> int:
    """The level a step of `n` rows counts at: the least of LEVELS at or above it (the
    largest beyond them)."""
    return LEVELS[min(bisect.bisect_left(LEVELS, n), len(LEVELS) - 1)]


def plain_decode(r: dict[str, float]) -> int | None:
    """The level of a plain decode step (no prompt tokens, no insertion) whose batch is
    near its level's width; None for any other step."""
    if r[PROMPT] or r[INSERTED] or not r[GENERATED]:
        return None
    lv = level(r[GENERATED])
    return lv if r[GENERATED] >= 0.9 * lv else None


def decode_steps(trace: list[dict[str, float]]) -> dict[int, list[float]]:
    """Plain decode steps with the batch near its level's width: ms by level."""
    out: dict[int, list[float]] = {}
    for r in trace:
        if (lv := plain_decode(r)) is not None:
            out.setdefault(lv, []).append(r[NEXT] * 1e3)
    return out


def decode_loops(trace: list[dict[str, float]]) -> dict[int, dict[str, list[float]]]:
    """The same plain decode steps seen as turns of the actor's loop, ms by level: the
    period (this step's start to the next's), the exchange before it, and the stepping
    thread's CPU over the turn (traces that have it). CPU well below the period is a
    turn that waited (for the GPU, the event loop or the GIL)."""
    out: dict[int, dict[str, list[float]]] = {}
    for a, b in zip(trace, trace[1:], strict=False):
        if (lv := plain_decode(a)) is not None and b[T] - a[T] <= 1.0:
            d = out.setdefault(lv, {})
            d.setdefault("period", []).append((b[T] - a[T]) * 1e3)
            d.setdefault("exchange", []).append(b[EXCHANGE] * 1e3)
            if CPU in b:
                d.setdefault("cpu", []).append(b[CPU] * 1e3)
    return out


def own_work(trace: list[dict[str, float]]) -> dict[int, dict[str, list[float]]]:
    """ms between one step's `next()` and the next step's, less the exchange, by level and
    by whether the actor removed rows before the step (retired rows were waiting)."""
    out: dict[int, dict[str, list[float]]] = {}
    for prev, a, b in zip(trace, trace[1:], trace[2:], strict=False):
        gap = b[T] - a[T] - a[NEXT] - b[EXCHANGE]
        if gap > 1.0:  # an idle server between paired halves
            continue
        removed = prev[RETIRED] > 0 and (a[INSERTED] > 0 or a[RETIRED] == 0)
        kind = "removal" if removed else "other"
        out.setdefault(level(max(a[LIVE], 1)), {}).setdefault(kind, []).append(gap * 1e3)
    return out


def step_kinds(trace: list[dict[str, float]]) -> dict[str, list[float]]:
    """Every step's time by kind, whatever its level: a step that took prompt tokens
    (`prefill`: mlx_lm runs the decoding rows' step in it too), inserted rows
    (`insert`), removed retired ones (`removal`), or only decoded (`decode`); and the
    line of a dry batch's rows leaving after the report of the step that emptied it
    (`settle`: no tokens, a wait for the device in `settle_s`, traces that have it).
    Values: [steps, seconds in `next()`, seconds of the stepping thread's CPU]."""
    out: dict[str, list[float]] = {}
    for r in trace:
        if not (r[GENERATED] or r[PROMPT]):
            if not r.get(SETTLE):
                continue  # an empty turn: an idle actor's
            kind = "settle"
        else:
            kind = ("prefill" if r[PROMPT] else "insert" if r[INSERTED] else
                    "removal" if r[RETIRED] else "decode")  # fmt: skip
        k = out.setdefault(kind, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += r[NEXT]
        k[2] += r.get(CPU, 0.0)
    return out


def requests_summary(path: str) -> str | None:
    """The request trace beside a server's step trace (FILE.requests), if there is one: its
    requests' intake (arrival to admission) and return gap (arrival less the latest end of
    an earlier request, under a second: a client in a loop coming back), medians and maxima."""
    try:
        requests = rows(path)
    except FileNotFoundError:
        return None
    done = [r for r in requests if r["intake_s"] and r["e2e_s"]]
    if not done:
        return None
    ends = sorted(float(r["arrived"]) + float(r["e2e_s"]) for r in done)
    intake = [1e3 * float(r["intake_s"]) for r in done]
    gaps = []
    for r in done:
        t = float(r["arrived"])
        i = bisect.bisect_right(ends, t)
        if i and t - ends[i - 1] < 1.0:
            gaps.append(1e3 * (t - ends[i - 1]))
    line = (f"requests: {len(done)}; intake p50 {statistics.median(intake):.1f} ms, "
            f"max {max(intake):.1f}")  # fmt: skip
    if gaps:
        line += f"; return gap p50 {statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ({len(gaps)} requests)"
    return line


def report(server_path: str, ceiling_path: str | None = None) -> list[str]:
    """The report's lines: one per level the server's trace reached, its steps by kind,
    and its requests' line where it wrote a request trace beside."""
    server = load(server_path)
    ceiling = decode_steps(load(ceiling_path)) if ceiling_path else {}
    steps, work, loops = decode_steps(server), own_work(server), decode_loops(server)
    lines = []
    for lv in LEVELS:
        if lv not in steps:
            continue
        line = f"c={lv}: decode p50 {statistics.median(steps[lv]):.2f} ms"
        if lv in ceiling:
            ratio = statistics.median(steps[lv]) / statistics.median(ceiling[lv])
            line += f" (ceiling {statistics.median(ceiling[lv]):.2f}, x{ratio:.2f})"
        for kind, ms in loops.get(lv, {}).items():
            line += f"; {kind} p50 {statistics.median(ms):.2f}"
        for kind, ms in sorted(work.get(lv, {}).items()):
            line += f"; {kind}: {len(ms)} steps, p50 {statistics.median(ms):.2f} ms, {sum(ms) / 1e3:.2f} s"
        lines.append(line)
    kinds = step_kinds(server)
    total = sum(k[1] for k in kinds.values()) or 1.0
    lines.append("steps by kind: " + "; ".join(
        f"{kind} {int(n)} steps, {s:.2f} s ({s / total:.0%}), mean {1e3 * s / n:.1f} ms, cpu {c:.2f} s"
        for kind, (n, s, c) in sorted(kinds.items())))  # fmt: skip
    base = server_path[:-3] if server_path.endswith(".gz") else server_path
    for path in (base + ".requests", base + ".requests.gz"):
        if (summary := requests_summary(path)) is not None:
            lines.append(summary)
            break
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="trio-mlx bench trace",
        description="Read a server's step trace (TRIO_MLX_STEP_TRACE) level by level, beside the "
        "ceiling's (TRIO_MLX_CEILING_TRACE) if given: median decode step, loop period, exchange, "
        "CPU and the actor's own work per level, every step's time by kind, and the request "
        "trace beside (SERVER_TRACE.requests) where there is one. Traces may be gzipped.",
    )
    p.add_argument("server", metavar="SERVER_TRACE", help="the server's step trace")
    p.add_argument("ceiling", metavar="CEILING_TRACE", nargs="?",
                   help="the ceiling's step trace, for its median decode step per level")  # fmt: skip
    a = p.parse_args(argv)
    try:
        lines = report(a.server, a.ceiling)
    except KeyError as exc:
        raise SystemExit(f"trio-mlx bench trace: the trace has no column {exc} (a trace older "
                         "than the columns read here?)") from None
    except (OSError, StopIteration, ValueError) as exc:
        raise SystemExit(f"trio-mlx bench trace: cannot read the trace: {exc!r}") from None
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0
