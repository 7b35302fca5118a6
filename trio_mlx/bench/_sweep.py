"""`trio-mlx bench --url`: the sweep's levels against a server, over streaming SSE
(`_http.py`): closed-loop concurrency or Poisson arrivals, each level's figures with the
client's and the server's CPU per token (`--server-pid`, from /proc), and, with `--paired`,
the raw ceiling run in this process and interleaved with the server level by level."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio_mlx

from ._limit import bare_waves
from ._limit import ceiling_level as run_ceiling_level
from ._progress import LevelBar, level_label
from ._prompts import Prompt, request_lengths
from ._stats import RequestRecord, in_process_level, level_stats

if TYPE_CHECKING:
    from ._http import HttpxClient, RawClient


def request_body(args: argparse.Namespace, prompt: Prompt, max_tokens: int, model: str) -> bytes:
    from ._http import dumps

    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": args.temperature,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    body.update(args.extra_body)
    return dumps(body)


def _proc_cpu(pid: int | None) -> tuple[float, float] | None:
    """(whole process, main thread) CPU seconds of a local process, from /proc (Linux).

    The process figure comes from /proc/PID/stat (clock ticks, and it keeps
    the time of threads that have exited), plus that of its running children
    (a process actor, `--actor process`); the main thread's (the event loop
    of a trio server) from its schedstat, in nanoseconds, where available.
    """
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")

    def ticks(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    try:
        total = ticks(f"/proc/{pid}/stat")
    except OSError:
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # its parent
                        total += ticks(f"/proc/{entry}/stat")
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            main_thread = int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        main_thread = ticks(f"/proc/{pid}/task/{pid}/stat")
    return total, main_thread


async def run_http(
    args: argparse.Namespace,
    plan: list[tuple[int | None, float | None, int]],
    prompts: list[Prompt],
    warm: Sequence[Prompt] = (),
    paired: Any = None,
    on_paired_level: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the plan's levels against `args.url`, each on the next prompts; one stats dict each.

    The `warm` prompts go first, all at once with 8 output tokens, unmeasured.
    With `paired` (a `trio_mlx.actor.ceiling.Ceiling`), each closed-loop level runs on it
    too, interleaved (`_run_paired_level`), and each of the ceiling's levels
    goes to `on_paired_level`.
    """
    import trio

    from ._http import HttpxClient, RawClient, stream_request

    base = args.url.rstrip("/")
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    peak = max((c or 0) for c, _, _ in plan) or None
    client: RawClient | HttpxClient = (
        HttpxClient(base, peak, args.timeout) if args.client == "httpx" else RawClient(base)
    )
    levels: list[dict[str, Any]] = []
    try:
        if not args.served_model_name:
            data = (await client.get_json("/v1/models")).get("data") or []
            if not data:
                raise SystemExit(f"{base}/v1/models lists no model; pass --served-model-name")
            args.served_model_name = str(data[0]["id"])
        model = args.served_model_name
        every_length = request_lengths(len(prompts), args.max_tokens, args.max_tokens_spread, seed=args.seed)
        pos = 0
        async with trio.open_nursery() as nursery:
            for p in warm:
                body = request_body(args, p, 8, model)
                nursery.start_soon(stream_request, client, path, body, 8, args.timeout)
        for concurrency, rate, n in plan:
            mine = prompts[pos : pos + n]
            lengths = every_length[pos : pos + n]
            bodies = [request_body(args, p, m, model) for p, m in zip(mine, lengths, strict=True)]
            pos += n
            if paired is not None and concurrency is not None and n >= 2:
                assert on_paired_level is not None
                records, duration, client_cpu, srv0, ceiling_level = await _run_paired_level(
                    client, path, bodies, lengths, [p.ids for p in mine], concurrency, args, paired)
                on_paired_level(ceiling_level)
            else:
                cpu0, srv0 = time.process_time(), _proc_cpu(args.server_pid)
                t0 = time.perf_counter()
                records = await _run_level(client, path, bodies, lengths, concurrency, rate, args)
                duration = time.perf_counter() - t0
                client_cpu = time.process_time() - cpu0
            extra = _cpu_figures(records, client_cpu, srv0, args.server_pid)
            levels.append(
                level_stats(
                    records, duration=duration, concurrency=concurrency, rate=rate, extra=extra
                )
            )
            print_level(levels[-1], args)
            if (checkpoint := getattr(args, "checkpoint", None)) is not None:
                checkpoint(levels)
    finally:
        await client.aclose()
    return levels


async def _run_paired_level(
    client: RawClient | HttpxClient,
    path: str,
    bodies: list[bytes],
    lengths: Sequence[int],
    ids: Sequence[Sequence[int]],
    concurrency: int,
    args: argparse.Namespace,
    paired: Any,
) -> tuple[list[RequestRecord], float, float, tuple[float, float] | None, dict[str, Any]]:
    """One level on the server and on the ceiling, interleaved so that both see the host
    at the same moments: its requests split into 2 x R chunks (R = --paired-rounds, fewer
    where a chunk would hold fewer than `concurrency` requests), each round running
    ceiling, server, server, ceiling on its two chunks (a host that speeds up or slows
    down steadily weighs on both alike). Returns the server's records, seconds and
    client CPU seconds (its runs only), its server CPU at the start, and the ceiling's
    level."""
    n = len(bodies)
    rounds = max(1, min(args.paired_rounds, n // (2 * concurrency)))
    cut = [n * i // (2 * rounds) for i in range(2 * rounds + 1)]
    records: list[RequestRecord] = []
    ceiling: list[RequestRecord] = []
    duration = client_cpu = ceiling_s = ceiling_cpu = 0.0
    srv0 = _proc_cpu(args.server_pid)
    srv_idle = [0.0, 0.0]  # the server's CPU while the ceiling ran (an idle server's housekeeping)
    for r in range(rounds):
        a, b, c = cut[2 * r], cut[2 * r + 1], cut[2 * r + 2]
        for on_server, lo, hi in ((False, a, b), (True, a, b), (True, b, c), (False, b, c)):
            if on_server:
                cpu0, t0 = time.process_time(), time.perf_counter()
                records += await _run_level(client, path, bodies[lo:hi], lengths[lo:hi], concurrency, None, args)
                duration += time.perf_counter() - t0
                client_cpu += time.process_time() - cpu0
            else:
                before = _proc_cpu(args.server_pid)
                run = bare_waves if paired.bg is None else run_ceiling_level
                recs, seconds, cpu = run(paired, ids[lo:hi], concurrency, args.max_tokens)
                after = _proc_cpu(args.server_pid)
                if before is not None and after is not None:
                    srv_idle = [srv_idle[i] + after[i] - before[i] for i in (0, 1)]
                ceiling += recs
                ceiling_s += seconds
                ceiling_cpu += cpu
    if srv0 is not None:
        srv0 = (srv0[0] + srv_idle[0], srv0[1] + srv_idle[1])
    ceiling_level = in_process_level(
        ceiling, duration=ceiling_s, concurrency=concurrency, cpu_s=ceiling_cpu, cpu_name="client",
    )  # fmt: skip
    ceiling_level["ceiling"] = "bare" if paired.bg is None else "batchgenerator"
    return records, duration, client_cpu, srv0, ceiling_level


async def _run_level(
    client: RawClient | HttpxClient,
    path: str,
    bodies: list[bytes],
    lengths: Sequence[int],
    concurrency: int | None,
    rate: float | None,
    args: argparse.Namespace,
) -> list[RequestRecord]:
    """Send every body, closed loop (`concurrency` in flight) or Poisson arrivals at `rate`/s;
    `lengths`: each body's max_tokens, which its answer must fill."""
    import trio

    from ._http import stream_request

    records = [RequestRecord() for _ in bodies]
    bar = LevelBar(level_label(concurrency, rate), len(bodies))

    async def one(i: int) -> None:
        records[i] = await stream_request(client, path, bodies[i], lengths[i], args.timeout)
        bar.done(records[i].output_tokens)

    with bar:
        async with trio.open_nursery() as nursery:
            if concurrency is not None:
                todo = iter(range(len(bodies)))

                async def worker() -> None:
                    for i in todo:  # one shared iterator: the closed loop
                        await one(i)

                for _ in range(min(concurrency, len(bodies))):
                    nursery.start_soon(worker)
            else:
                assert rate is not None
                rng = random.Random(args.seed + 1)
                cap = trio.CapacityLimiter(args.max_concurrency or 1_000_000)

                async def capped(i: int) -> None:
                    async with cap:
                        await one(i)

                t = trio.current_time()
                for i in range(len(bodies)):
                    if math.isfinite(rate):
                        t += rng.expovariate(rate)
                        await trio.sleep_until(t)
                    nursery.start_soon(capped, i)
    return records


def _cpu_figures(
    records: Sequence[RequestRecord],
    client_cpu: float,
    srv0: tuple[float, float] | None,
    pid: int | None,
) -> dict[str, Any]:
    tokens = sum(r.output_tokens for r in records) or 1
    out: dict[str, Any] = {
        "client_cpu_s": client_cpu,
        "client_cpu_us_per_token": client_cpu / tokens * 1e6,
    }
    srv1 = _proc_cpu(pid)
    if srv0 is not None and srv1 is not None:
        out["server_cpu_s"] = srv1[0] - srv0[0]
        out["server_cpu_us_per_token"] = (srv1[0] - srv0[0]) / tokens * 1e6
        out["server_main_thread_cpu_s"] = srv1[1] - srv0[1]
        out["server_main_thread_cpu_us_per_token"] = (srv1[1] - srv0[1]) / tokens * 1e6
    return out


def print_level(lv: dict[str, Any], args: argparse.Namespace) -> None:
    if args.quiet:
        return
    where = f"c={lv['concurrency']}" if lv["concurrency"] is not None else f"rate={lv['rate']}/s"
    if lv.get("ceiling") == "bare":
        where += " bare"
    ttft, tpot = lv["ttft_ms"], lv["tpot_ms"]

    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    errs = lv["errors"]
    line = (
        f"{where:>10}  {f(lv['output_throughput'])} tok/s  {f(lv['request_throughput'], '.2f')} req/s  "
        f"TTFT p50 {f(ttft['p50'])} p99 {f(ttft['p99'])} ms  TPOT p50 {f(tpot['p50'], '.2f')} ms  "
        f"errors {errs['total']}/{lv['requests']}"
    )
    if errs["total"]:
        line += " " + json.dumps(errs["by_reason"])
    print(line, file=sys.stderr, flush=True)


def run_paired(
    args: argparse.Namespace,
    plan: list[tuple[int | None, float | None, int]],
    prompts: list[Prompt],
    warm: Sequence[Prompt],
    result: dict[str, Any],
) -> list[dict[str, Any]]:
    """`--paired`: the server's levels, with the ceiling's interleaved and written to args.paired."""
    import trio

    from ._limit import CEILING_TRACE_ENV, ceiling_module

    max_batch = args.max_batch or max(c for c, _, _ in plan if c is not None)
    settings = {"completion_batch_size": max_batch, "prefill_batch_size": args.prefill_batch_size,
                "prefill_step_size": args.prefill_step_size}  # fmt: skip
    ceiling_api = ceiling_module()
    ceiling = ceiling_api.Ceiling(
        args.model, warmup=[p.ids for p in warm], max_tokens=args.max_tokens, seed=args.seed,
        cache_limit_gb=trio_mlx.ActorTuning.from_env().cache_limit_gb, trace=os.environ.get(CEILING_TRACE_ENV),
        batch_generator=args.ceiling != "bare", **settings)  # fmt: skip
    levels: list[dict[str, Any]] = []
    label = f"{args.label} ceiling (paired)" if args.label else "ceiling (paired)"
    paired = {**result, "label": label, "target": "limit", "paired_with": args.url,
              "settings": settings, "device": ceiling_api.device_info(), "levels": levels}  # fmt: skip

    def save() -> None:
        Path(args.paired).write_text(json.dumps(paired, indent=1) + "\n")

    def add(level: dict[str, Any]) -> None:  # saved at once: a run cut short by a time cap keeps it
        levels.append(level)
        save()

    try:
        served = trio.run(run_http, args, plan, prompts, warm, ceiling, add)
    finally:
        ceiling.close()
        save()
    return served
