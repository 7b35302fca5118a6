"""Figures and reports of `trio-mlx bench`: per-request records, per-level statistics, the
markdown table and the PNG. Pure Python (matplotlib only when a plot is drawn), shared by the
HTTP mode and the in-process ceiling (`_limit.py`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of already sorted values, linearly interpolated (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean, min, p50/p90/p99, max of `values` times `scale` (seconds -> ms by default)."""
    xs = sorted(v * scale for v in values)
    out: dict[str, float | int | None] = {"n": len(xs)}
    if not xs:
        out.update({k: None for k in ("mean", "min", *(f"p{q}" for q in PERCENTILES), "max")})
        return out
    out["mean"] = sum(xs) / len(xs)
    out["min"] = xs[0]
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["max"] = xs[-1]
    return out


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds from its send (or insert)."""

    error: str | None = None  # a reason category; None means the request succeeded
    message: str | None = None  # the first words of what went wrong
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    events: int = 0  # content-bearing stream events (an event may carry several tokens)
    itl: list[float] = field(default_factory=list)  # gaps between content events
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def check_length(rec: RequestRecord, max_tokens: int) -> None:
    """Mark a finished request as an error unless it produced exactly `max_tokens` tokens."""
    if rec.error is None and rec.output_tokens != max_tokens:
        kind = "short_output" if rec.output_tokens < max_tokens else "excess_output"
        rec.error = kind
        rec.message = (
            f"{rec.output_tokens} tokens of {max_tokens} asked (finish_reason={rec.finish_reason})"
        )


def level_stats(
    records: Sequence[RequestRecord],
    *,
    duration: float,
    concurrency: int | None,
    rate: float | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The per-level figures, computed from every request's record (none dropped)."""
    ok = [r for r in records if r.error is None]
    by_reason: dict[str, int] = {}
    samples: dict[str, str] = {}
    for r in records:
        if r.error is not None:
            by_reason[r.error] = by_reason.get(r.error, 0) + 1
            samples.setdefault(r.error, r.message or "")
    tokens = sum(r.output_tokens for r in records)
    events = sum(r.events for r in records)
    stats: dict[str, Any] = {
        "concurrency": concurrency,
        "rate": rate,
        "requests": len(records),
        "completed": len(ok),
        "errors": {"total": len(records) - len(ok), "by_reason": by_reason, "samples": samples},
        "duration_s": duration,
        "output_tokens": tokens,
        "output_throughput": tokens / duration if duration > 0 else None,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "tokens_per_event": tokens / events if events else None,
        "ttft_ms": summarize(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": summarize(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": summarize(x for r in ok for x in r.itl),
        "e2e_ms": summarize(r.e2e for r in ok if r.e2e is not None),
    }
    stats.update(extra or {})
    return stats



def in_process_level(
    records: Sequence[RequestRecord], *, duration: float, concurrency: int, cpu_s: float, cpu_name: str
) -> dict[str, Any]:
    """A closed-loop in-process level (--limit, --engine), with the CPU time of the
    measuring thread as `<cpu_name>_cpu_s` and per generated token."""
    tokens = sum(r.output_tokens for r in records) or 1
    extra = {f"{cpu_name}_cpu_s": cpu_s, f"{cpu_name}_cpu_us_per_token": cpu_s / tokens * 1e6}
    return level_stats(records, duration=duration, concurrency=concurrency, rate=None, extra=extra)

def level_key(level: dict[str, Any]) -> float:
    """The x of a level: its concurrency (closed loop) or its arrival rate (Poisson)."""
    return level["concurrency"] if level.get("concurrency") is not None else level["rate"]


# --------------------------------------------------------------- plot, table


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in paths]


def _run_name(res: dict[str, Any]) -> str:
    return str(res.get("label") or res.get("target") or "run")


def is_bare(level: dict[str, Any]) -> bool:
    """A level of the bare pipelined forward (`--limit --ceiling bare|both`), not a BatchGenerator's."""
    return level.get("ceiling") == "bare"


def _level_name(res: dict[str, Any], level: dict[str, Any]) -> str:
    """The name of the line or row a level belongs to: its run's, with " (bare)" for the bare forward's."""
    return _run_name(res) + (" (bare)" if is_bare(level) else "")


def plot_lines(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The plot's lines: run name -> its levels in order. Runs that share a name are one
    line (a level measured in a call of its own, such as c=1 in rounds, joins its sweep);
    a run that died before its first level draws none."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        for lv in res["levels"]:
            lines.setdefault(_level_name(res, lv), []).append(lv)
    return {name: sorted(lvs, key=level_key) for name, lvs in lines.items() if lvs}


def write_plot(results: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Output tok/s and TTFT p50 against concurrency (or rate), one line per run name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0] if results else {}
    lines = plot_lines(results)
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    rate_mode = any(lv.get("concurrency") is None for lvs in lines.values() for lv in lvs)
    for name, lvs in lines.items():
        xs = [level_key(lv) for lv in lvs]
        ax_tp.plot(xs, [lv["output_throughput"] or 0 for lv in lvs], "o-", label=name)
        ax_ttft.plot(xs, [lv["ttft_ms"]["p50"] or float("nan") for lv in lvs], "o-", label=name)
    xlabel = "arrival rate (requests/s)" if rate_mode else "concurrent requests"
    ticks = sorted({level_key(lv) for lvs in lines.values() for lv in lvs})
    for ax in (ax_tp, ax_ttft):
        ax.set_xlabel(xlabel)
        if not rate_mode and ticks:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.grid(True, which="both", alpha=0.3)
        if lines:
            ax.legend()
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("throughput")
    ax_ttft.set_ylabel("TTFT p50 (ms)")
    if any((lv["ttft_ms"]["p50"] or 0) > 0 for lvs in lines.values() for lv in lvs):
        ax_ttft.set_yscale("log")
    ax_ttft.set_title("time to first token")
    spread = first.get("max_tokens_spread") or 0
    fig.suptitle(
        f"{Path(str(first.get('model', ''))).name}  prompt {first.get('prompt_tokens')} / output "
        f"{first.get('max_tokens')}{f' ± {spread:.0%}' if spread else ''} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _physical(res: dict[str, Any], ceilings: Sequence[dict[str, Any]],
              bandwidth_gbs: float | None) -> tuple[dict[str, Any] | None, float | None]:
    """(footprint, bandwidth) for a run's fraction of the physical limit: its own record,
    else a ceiling's of the same model; the bandwidth given to the table first."""
    def has_bytes(r: dict[str, Any]) -> bool:
        return bool((r.get("physical") or {}).get("weight_bytes"))

    same = [c for c in ceilings if c.get("model") == res.get("model")]
    fp = next((r["physical"] for r in (res, *same) if has_bytes(r)), None)
    gbs = bandwidth_gbs
    for r in (res, *ceilings):
        if gbs is None:
            gbs = (r.get("physical") or {}).get("bandwidth_gbs")
    return fp, gbs


def format_table(
    results: Sequence[dict[str, Any]], ceiling: dict[str, Any] | None = None, *, bandwidth_gbs: float | None = None
) -> str:
    """A markdown table, one row per run and level, with the ratio to the ceilings' throughput.

    Without `ceiling`, every `--limit` run among `results` is one: a level's
    ceiling is the best of them. A GPU host's speed drifts by tens of percent
    within minutes, so the ceiling is measured before and after the servers
    (scripts/gpu_bench.sh) and the faster of the two is the bar. "x ceiling"
    is the ratio to the BatchGenerator's, "x bare" (when a ceiling has bare
    levels) to the bare pipelined forward's; a run's bare levels are rows of
    their own, " (bare)", beside its BatchGenerator's. "x mem limit" (when a
    bandwidth is known: `bandwidth_gbs`, else what the runs recorded, and the
    model's bytes are) is `_physical.fraction_of_limit`.
    """
    from ._physical import fraction_of_limit

    ceilings = [ceiling] if ceiling is not None else [r for r in results if r.get("target") == "limit"]
    base: dict[int, float] = {}  # concurrency -> throughput: the ceiling runs the closed loop only
    bare: dict[int, float] = {}
    for c in ceilings:
        for lv in c.get("levels", []):
            if lv["output_throughput"] and (k := lv.get("concurrency")) is not None:
                bar = bare if is_bare(lv) else base
                bar[k] = max(bar.get(k, 0.0), lv["output_throughput"])
    physical = {id(r): _physical(r, ceilings, bandwidth_gbs) for r in results}
    limit = any(fp is not None and gbs for fp, gbs in physical.values())
    srv = any("server_cpu_us_per_token" in lv for r in results for lv in r["levels"])
    head = ["run", "level", "out tok/s", "x ceiling"]
    if bare:
        head += ["x bare"]
    if limit:
        head += ["x mem limit"]
    head += ["req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ITL p99 ms", "errors"]
    if srv:
        head += ["srv CPU us/tok", "srv main-thread us/tok"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    def ratio(tp: float | None, c: int | None, bar: dict[int, float]) -> float | None:
        return tp / bar[c] if tp is not None and c is not None and bar.get(c) else None

    for res in results:
        fp, gbs = physical[id(res)]
        for lv in sorted(res["levels"], key=lambda lv: (level_key(lv), is_bare(lv))):
            k = level_key(lv)
            tp = lv["output_throughput"]
            c = lv.get("concurrency")
            where = f"c={k}" if c is not None else f"{k}/s"
            errs = lv["errors"]
            err = str(errs["total"])
            if errs["total"]:
                err += " (" + ", ".join(f"{n} {why}" for why, n in errs["by_reason"].items()) + ")"
            cells = [_level_name(res, lv), where, f(tp, ".0f"), f(ratio(tp, c, base), ".2f")]
            if bare:
                cells += [f(ratio(tp, c, bare), ".2f")]
            if limit:
                frac = None
                if fp is not None and gbs and res.get("prompt_tokens") and res.get("max_tokens"):
                    frac = fraction_of_limit(lv, fp, gbs, int(res["prompt_tokens"]), int(res["max_tokens"]))
                cells += [f(frac, ".2f")]
            cells += [f(lv["request_throughput"], ".2f"), f(lv["ttft_ms"]["p50"]),
                      f(lv["ttft_ms"]["p99"]), f(lv["tpot_ms"]["p50"], ".2f"),
                      f(lv["itl_ms"]["p99"], ".2f"), err]  # fmt: skip
            if srv:
                cells += [f(lv.get("server_cpu_us_per_token")),
                          f(lv.get("server_main_thread_cpu_us_per_token"))]  # fmt: skip
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
