"""`trio-mlx bench`: a load generator for OpenAI-compatible endpoints.

Drives any server (`--url`) over streaming SSE with trio (`_http.py`),
or, with `--limit`, the raw ceilings in-process on the same model and prompts:
mlx_lm's BatchGenerator and MLX's bare pipelined decode forward, the bars a
server is judged against (`_limit.py`, over `trio_mlx.actor.ceiling`, which
drives MLX). Each run records the model's bytes and the device's bandwidth
for the fraction of the physical limit (`_physical.py`). Figures, tables and plots are in
`_stats.py`. Two load shapes: a closed-loop concurrency
sweep (`--concurrency 1,8,32`) and Poisson arrivals (`--rate 2,4`). Prompts are
random token ids of an exact token length under the model's tokenizer, each
one distinct so that prefix caches don't flatter; outputs have a fixed length
(`max_tokens` + `ignore_eos`). Per level it reports TTFT, TPOT, ITL and
end-to-end latency (mean/p50/p90/p99), output tok/s, requests/s and every
failed request by reason; it writes JSON (`--out`), a PNG (`--plot`), and
compares runs: `trio-mlx bench plot a.json b.json -o x.png`,
`trio-mlx bench table a.json b.json`. `trio-mlx bench trace` reads step
traces level by level (`_trace.py`).

This module makes the prompts, runs the sweep and owns the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio_mlx

from ..engine import freeze_heap
from ._limit import ceiling_level as run_ceiling_level
from ._progress import LevelBar, level_label
from ._stats import (
    RequestRecord,
    format_table,
    in_process_level,
    level_stats,
    load_results,
    write_plot,
)

if TYPE_CHECKING:
    from ._http import HttpxClient, RawClient

SCHEMA = "trio-mlx-bench/1"
LIMIT_WARMUP = 4  # sequences in --limit's warm-up batch: arbitrary, just small


# ------------------------------------------------------------------- prompts


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    ids: tuple[int, ...]  # what the server's tokenizer makes of it, template included (chat)


def load_tokenizer(model: str) -> Any:
    from .. import models

    return models.load_tokenizer(models.resolve_model(model))


def make_prompts(
    tokenizer: Any, n: int, length: int, *, seed: int = 0, chat: bool = False
) -> list[Prompt]:
    """`n` distinct prompts that the tokenizer encodes to exactly `length` tokens.

    Random token ids are decoded to text and the text re-encoded the way a
    server does (`encode(text)` with the tokenizer's default special tokens,
    or the chat template around a user message); merges across token
    boundaries change the count, so ids are dropped or added until it fits.
    """
    if chat:

        def encode(text: str) -> list[int]:
            return list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True
                )
            )
    else:

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text))

    overhead = len(encode(""))
    if length - overhead < 1:
        raise ValueError(f"prompt length {length} leaves no room after {overhead} template tokens")
    # Where the content starts (after a BOS or the chat template's head): no
    # two prompts share their first two content tokens, so no prefix cache
    # can reuse one prompt's work for another beyond the template itself.
    a, b = encode("hello"), encode("world")
    lead = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    ordinary = _ordinary_ids(tokenizer)
    if len(ordinary) < 2:
        raise ValueError("the tokenizer has no ordinary tokens to draw from")
    rng = random.Random(seed)

    def draw() -> int:
        return ordinary[rng.randrange(len(ordinary))]

    prompts: list[Prompt] = []
    heads: set[tuple[int, ...]] = set()
    for _attempt in range(100 * n + 100):  # arbitrary bound: fails loudly, never spins
        if len(prompts) == n:
            break
        content = [draw() for _ in range(length - overhead)]
        for _ in range(64):  # arbitrary; it fits within a few rounds in practice
            text = tokenizer.decode(content)
            ids = tuple(encode(text))
            diff = len(ids) - length
            if diff == 0:
                head = ids[lead : lead + 2]
                if head not in heads:
                    heads.add(head)
                    prompts.append(Prompt(text, ids))
                break
            if diff > 0:
                content = content[:-diff] if diff < len(content) else [draw()]
            else:
                content += [draw() for _ in range(-diff)]
    else:
        raise ValueError(f"could not make {n} distinct prompts of {length} tokens")
    return prompts


def _ordinary_ids(tokenizer: Any) -> list[int]:
    """The ids encoding can produce: a token decoded alone re-encodes to itself.

    That leaves out special and added tokens (`<|im_end|>`), vocabulary
    padding no merge reaches (the test models' `<|x123|>`), and lone pieces of
    multi-byte characters. One batch through the Rust tokenizer when there is
    one (~1 s for a 128k vocabulary on 2 cores), else one id at a time.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx_lm's TokenizerWrapper wraps HF's
    banned = set(getattr(hf, "all_special_ids", None) or [])
    banned |= set(getattr(hf, "added_tokens_decoder", None) or {})
    ids = [i for i in range(len(hf)) if i not in banned]
    rust: Any = getattr(hf, "_tokenizer", None)
    if hasattr(rust, "decode_batch") and hasattr(rust, "encode_batch"):
        texts = rust.decode_batch([[i] for i in ids], skip_special_tokens=False)
        again = [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]
    else:
        again = [hf.encode(hf.decode([i]), add_special_tokens=False) for i in ids]
    return [i for i, e in zip(ids, again, strict=True) if list(e) == [i]]


def model_from_server(url: str, timeout: float) -> tuple[str, str]:
    """(a model reference to load the tokenizer from, the served id), from GET /v1/models:
    the card's `root` (the directory the server loaded, as vLLM names it) when it exists
    here, else its id (the embedded default's, or a hub id, resolves as such)."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=min(timeout, 30.0))
        resp.raise_for_status()
        card = (resp.json().get("data") or [None])[0]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise SystemExit(f"trio-mlx bench: no --model given and {url}/v1/models failed: {exc}") from None
    if not isinstance(card, dict) or not isinstance(card.get("id"), str):
        raise SystemExit(f"trio-mlx bench: {url}/v1/models names no model; pass --model")
    root = card.get("root")
    if isinstance(root, str) and Path(root).is_dir():
        return root, card["id"]
    return card["id"], card["id"]


def warmup_count(args: argparse.Namespace) -> int:
    """Warm-up requests: --warmup, else 2 over HTTP and LIMIT_WARMUP in-process."""
    if args.warmup is not None:
        return int(args.warmup)
    return 2 if args.url else LIMIT_WARMUP


def levels_and_counts(args: argparse.Namespace) -> list[tuple[int | None, float | None, int]]:
    """(concurrency, rate, requests) for every level of the sweep."""
    out: list[tuple[int | None, float | None, int]] = []
    if args.rate:
        for r in args.rate:
            out.append((None, r, args.requests_per_level or args.min_requests))
    else:
        for c in args.concurrency:
            n = args.requests_per_level or max(args.requests_multiple * c, args.min_requests)
            out.append((c, None, n))
    return out


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
        pos = 0
        async with trio.open_nursery() as nursery:
            for p in warm:
                body = request_body(args, p, 8, model)
                nursery.start_soon(stream_request, client, path, body, 8, args.timeout)
        for concurrency, rate, n in plan:
            mine = prompts[pos : pos + n]
            bodies = [request_body(args, p, args.max_tokens, model) for p in mine]
            pos += n
            if paired is not None and concurrency is not None and n >= 2:
                assert on_paired_level is not None
                records, duration, client_cpu, srv0, ceiling_level = await _run_paired_level(
                    client, path, bodies, [p.ids for p in mine], concurrency, args, paired)
                on_paired_level(ceiling_level)
            else:
                cpu0, srv0 = time.process_time(), _proc_cpu(args.server_pid)
                t0 = time.perf_counter()
                records = await _run_level(client, path, bodies, concurrency, rate, args)
                duration = time.perf_counter() - t0
                client_cpu = time.process_time() - cpu0
            extra = _cpu_figures(records, client_cpu, srv0, args.server_pid)
            levels.append(
                level_stats(
                    records, duration=duration, concurrency=concurrency, rate=rate, extra=extra
                )
            )
            _print_level(levels[-1], args)
            if (checkpoint := getattr(args, "checkpoint", None)) is not None:
                checkpoint(levels)
    finally:
        await client.aclose()
    return levels


async def _run_paired_level(
    client: RawClient | HttpxClient,
    path: str,
    bodies: list[bytes],
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
                records += await _run_level(client, path, bodies[lo:hi], concurrency, None, args)
                duration += time.perf_counter() - t0
                client_cpu += time.process_time() - cpu0
            else:
                before = _proc_cpu(args.server_pid)
                recs, seconds, cpu = run_ceiling_level(paired, ids[lo:hi], concurrency, args.max_tokens)
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
    return records, duration, client_cpu, srv0, ceiling_level


async def _run_level(
    client: RawClient | HttpxClient,
    path: str,
    bodies: list[bytes],
    concurrency: int | None,
    rate: float | None,
    args: argparse.Namespace,
) -> list[RequestRecord]:
    """Send every body, closed loop (`concurrency` in flight) or Poisson arrivals at `rate`/s."""
    import trio

    from ._http import stream_request

    records = [RequestRecord() for _ in bodies]
    bar = LevelBar(level_label(concurrency, rate), len(bodies))

    async def one(i: int) -> None:
        records[i] = await stream_request(client, path, bodies[i], args.max_tokens, args.timeout)
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


def _print_level(lv: dict[str, Any], args: argparse.Namespace) -> None:
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


# ----------------------------------------------------------------------- CLI


def _csv(kind: type) -> Callable[[str], list[Any]]:
    def parse(s: str) -> list[Any]:
        vals = [kind(x) for x in s.split(",") if x.strip()]
        if not vals or any(v <= 0 for v in vals):
            raise argparse.ArgumentTypeError(f"expected positive comma-separated values, got {s!r}")
        return vals

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trio-mlx bench",
        usage="%(prog)s (--url URL | --limit | --engine) [--model MODEL] [options]\n"
        "       %(prog)s plot A.json [B.json ...] -o OUT.png\n"
        "       %(prog)s table A.json [B.json ...] [--ceiling C.json] [-o OUT.md]\n"
        "       %(prog)s chat --url URL [options]\n"
        "       %(prog)s trace SERVER_TRACE [CEILING_TRACE]",
        description="Load-test an OpenAI-compatible endpoint (--url) or the raw ceilings "
        "(--limit: mlx_lm's BatchGenerator and MLX's bare pipelined forward). Also: `trio-mlx bench plot A.json [B.json ...] -o out.png` and "
        "`trio-mlx bench table A.json [B.json ...] [--ceiling C.json]`; multi-turn conversations "
        "with a shared system prompt (the prompt cache's load): `trio-mlx bench chat --url URL`; "
        "step traces (TRIO_MLX_STEP_TRACE) read level by level: `trio-mlx bench trace SERVER_TRACE "
        "[CEILING_TRACE]`.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of the server, e.g. http://127.0.0.1:8080")
    target.add_argument("--limit", action="store_true",
                        help="the ceilings in-process: mlx_lm's BatchGenerator and the bare forward (--ceiling)")  # fmt: skip
    target.add_argument("--engine", action="store_true",
                        help="drive trio_mlx's engine in-process through the channel API (no HTTP)")  # fmt: skip
    p.add_argument("--actor", choices=("thread", "process"), default="thread",
                   help="with --engine: run the engine's GPU actor on a thread or in a child process")  # fmt: skip
    p.add_argument("--admit-window", type=float, default=None, metavar="SECONDS",
                   help="with --engine: the engine's admit_window (default: TRIO_MLX_ADMIT_WINDOW, else the engine's own)")  # fmt: skip
    p.add_argument("--model",
                   help="model path or reference: its tokenizer makes the prompts (and --limit runs it); "
                   "with --url, default: what the server's GET /v1/models names")  # fmt: skip
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="HTTP client: raw (trio sockets, least CPU per token) or httpx")  # fmt: skip
    p.add_argument("--served-model-name",
                   help='the "model" field sent (default: the first id of GET /v1/models)')  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32],
                      help="closed loop: comma-separated in-flight request counts (default 1,8,32)")  # fmt: skip
    load.add_argument("--rate", type=_csv(float),
                      help="Poisson arrivals: comma-separated requests/s ('inf': all at once)")  # fmt: skip
    p.add_argument("--requests-per-level", type=int,
                   help="requests per level (default: --requests-multiple x concurrency)")  # fmt: skip
    p.add_argument("--requests-multiple", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8,
                   help="least requests per level (and the default count in --rate mode)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, help="--rate mode: cap on requests in flight")
    p.add_argument(
        "--warmup", type=int, default=None,
        help="short (8-token) requests run together before measuring, unmeasured: they compile "
        "kernels for the batch shapes to come (default: 2 over HTTP, 4 in-process)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")  # fmt: skip
    p.add_argument("--suppress-eos", action="store_true",
                   help="add logit_bias -100 on the EOS ids, for servers that ignore ignore_eos "
                   "(mlx_lm.server); it adds a per-sequence logits processor there")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--paired", metavar="CEILING_JSON",
                   help="with --url: also run the raw ceiling (--limit) in this process, each level "
                   "interleaved with the server's (ceiling, server, server, ceiling on halves of its "
                   "requests), so both see the host at the same moments; its results go here")  # fmt: skip
    p.add_argument("--paired-rounds", type=int, default=1, metavar="R",
                   help="with --paired: split each level into 2 x R chunks of at least its concurrency "
                   "and interleave round by round (finer pairing on a host whose speed drifts)")  # fmt: skip
    p.add_argument("--server-pid", type=int,
                   help="local server process: report its CPU (and main thread's) per output token")  # fmt: skip
    lim = p.add_argument_group("--limit settings (match the server's)")
    lim.add_argument("--max-batch", type=int,
                     help="completion batch size (default: the largest concurrency)")  # fmt: skip
    lim.add_argument("--prefill-batch-size", type=int, default=8)
    lim.add_argument("--prefill-step-size", type=int, default=2048)
    lim.add_argument("--ceiling", choices=("both", "bare", "batchgenerator"), default="both",
                     help="which ceilings --limit measures, level by level on the same model: mlx_lm's "
                     "BatchGenerator in a closed loop, MLX's bare pipelined decode forward (one wave of "
                     "c rows over plain KV caches), or both (default)")  # fmt: skip
    p.add_argument("--bandwidth-gbs", type=float, metavar="GB/S",
                   help="the device's memory bandwidth, for each level's fraction of the physical limit "
                   "(bytes a decode step reads over it); default: by MLX's device name where known "
                   "(--limit), else left out")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", help="names this run in tables and plots")
    p.add_argument("--device", help="free text describing the device (GPU, driver, wheels)")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--plot", help="write a PNG of this run here")
    p.add_argument("--quiet", action="store_true")
    return p


def _sub_main(name: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"trio-mlx bench {name}")
    p.add_argument("results", nargs="+", help="result JSON files of `trio-mlx bench --out`")
    if name == "plot":
        p.add_argument("-o", "--out", required=True, help="PNG to write")
        a = p.parse_args(argv)
        print(write_plot(load_results(a.results), a.out))
    else:
        p.add_argument(
            "--ceiling", help="the --limit run to compare with (default: the first given)"
        )
        p.add_argument("-o", "--out", help="also write the table to this file")
        p.add_argument("--bandwidth-gbs", type=float, metavar="GB/S",
                       help="the device's memory bandwidth, for the fraction of the physical limit "
                       "(default: what the runs recorded)")  # fmt: skip
        a = p.parse_args(argv)
        ceiling = load_results([a.ceiling])[0] if a.ceiling else None
        text = format_table(load_results(a.results), ceiling, bandwidth_gbs=a.bandwidth_gbs)
        sys.stdout.write(text)
        if a.out:
            Path(a.out).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plot", "table"):
        return _sub_main(argv[0], argv[1:])
    if argv and argv[0] == "chat":
        from ._chat import main as chat_main

        return chat_main(argv[1:])
    if argv and argv[0] == "trace":
        from ._trace import main as trace_main

        return trace_main(argv[1:])
    args = _parser().parse_args(argv)
    if (args.limit or args.engine or args.paired) and args.rate:
        raise SystemExit("trio-mlx bench: --limit/--engine/--paired run the closed loop only (use --concurrency)")
    if args.paired_rounds < 1:
        raise SystemExit("trio-mlx bench: --paired-rounds must be at least 1")
    if args.paired and not args.url:
        raise SystemExit("trio-mlx bench: --paired pairs a server (--url) with the ceiling")
    if args.ceiling != "both" and not args.limit:
        raise SystemExit("trio-mlx bench: --ceiling picks what --limit measures (--paired: the BatchGenerator)")
    if args.bandwidth_gbs is not None and args.bandwidth_gbs <= 0:
        raise SystemExit("trio-mlx bench: --bandwidth-gbs must be positive")
    if args.limit and args.endpoint == "chat":
        print("note: --limit feeds the chat-templated token ids", file=sys.stderr)

    if args.model is None:
        if not args.url:
            raise SystemExit("trio-mlx bench: --limit and --engine need --model")
        args.model, served = model_from_server(args.url, args.timeout)
        args.served_model_name = args.served_model_name or served
    tokenizer = load_tokenizer(args.model)
    plan = levels_and_counts(args)
    total = sum(n for _, _, n in plan)
    # Warm-up prompts come after the measured ones, so the measured prompts
    # depend only on the seed and the plan: --limit and every server get the
    # very same ones.
    prompts = make_prompts(
        tokenizer,
        total + warmup_count(args),
        args.prompt_tokens,
        seed=args.seed,
        chat=args.endpoint == "chat",
    )
    prompts, warm = prompts[:total], prompts[total:]
    # The tokenizer and the prompts stay for the whole run: frozen out of the collector's walks,
    # so that this client's own full collections (hundreds of ms once the prompts are made)
    # cannot land in what it measures.
    freeze_heap()
    if args.suppress_eos:
        bias = {str(t): -100 for t in sorted(getattr(tokenizer, "eos_token_ids", None) or [])}
        args.extra_body = {"logit_bias": bias, **args.extra_body}

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": ["trio-mlx", "bench", *argv],
        "label": args.label,
        "device_description": args.device,
        "target": "limit" if args.limit else "engine" if args.engine else args.url,
        "mode": "rate" if args.rate else "concurrency",
        "endpoint": args.endpoint,
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "temperature": args.temperature,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
    }
    done: list[dict[str, Any]] = []

    def checkpoint(levels: list[dict[str, Any]]) -> None:
        """Write what is measured so far: a run cut short by a time cap keeps its levels."""
        if args.out:
            Path(args.out).write_text(json.dumps({**result, "levels": levels, "partial": True}, indent=1) + "\n")

    def level_done(lv: dict[str, Any]) -> None:
        _print_level(lv, args)
        done.append(lv)
        checkpoint(done)

    args.checkpoint = checkpoint
    if not args.limit:  # --limit sums the loaded model's parameters instead
        result["physical"] = _physical_record(args, _footprint_from_files(args.model), None)
    in_process = [(c, n) for c, _, n in plan if c is not None]
    if args.engine:
        from ._engine import run_engine

        tuning = bench_tuning(args, max_batch=args.max_batch or max(c for c, _ in in_process),
                              prefill_batch=args.prefill_batch_size, prefill_step=args.prefill_step_size)
        result["settings"] = {
            "max_batch": tuning.max_batch,
            "prefill_batch": tuning.prefill_batch,
            "prefill_step": tuning.prefill_step,
            "actor": args.actor,
            "admit_window": tuning.admit_window,
        }
        result["levels"] = run_engine(
            args.model,
            [p.ids for p in prompts],
            warmup=[p.ids for p in warm],
            plan=in_process,
            max_tokens=args.max_tokens,
            tuning=tuning,
            actor=args.actor,
            on_level=level_done,
        )
    elif args.limit:
        from ._limit import run_limit

        max_batch = args.max_batch or max(c for c, _, _ in plan if c is not None)
        result["settings"] = {
            "completion_batch_size": max_batch,
            "prefill_batch_size": args.prefill_batch_size,
            "prefill_step_size": args.prefill_step_size,
        }
        result["settings"]["ceilings"] = ceilings = _ceilings(args.ceiling)
        result["device"], result["levels"], fp = run_limit(
            args.model,
            [p.ids for p in prompts],
            warmup=[p.ids for p in warm],
            plan=[(c, n) for c, _, n in plan if c is not None],
            max_tokens=args.max_tokens,
            completion_batch_size=max_batch,
            prefill_batch_size=args.prefill_batch_size,
            prefill_step_size=args.prefill_step_size,
            seed=args.seed,
            cache_limit_gb=trio_mlx.ActorTuning.from_env().cache_limit_gb,
            on_level=level_done,
            ceilings=ceilings,
        )
        result["physical"] = _physical_record(args, fp, result["device"].get("device_name"))
    else:
        import trio

        if args.paired:
            result["levels"] = _run_paired(args, plan, prompts, warm, result)
        else:
            result["levels"] = trio.run(run_http, args, plan, prompts, warm)
        result["served_model_name"] = args.served_model_name
        short_stop = sum(
            lv["errors"]["by_reason"].get("short_output", 0) for lv in result["levels"]
        )
        if short_stop and not args.suppress_eos:
            print(
                f"note: {short_stop} requests ended short; a server that ignores `ignore_eos` "
                "(mlx_lm.server) stops at EOS: --suppress-eos biases EOS away instead",
                file=sys.stderr,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        write_plot([result], args.plot)
    errors = sum(lv["errors"]["total"] for lv in result["levels"])
    return 1 if errors else 0


def bench_tuning(args: argparse.Namespace, **flags: Any) -> trio_mlx.ActorTuning:
    """`--engine`'s actor tuning: the TRIO_MLX_* variables that tune a server's actor tune
    this one too (it runs in the bench's own process), under the bench's own flags."""
    window = {} if args.admit_window is None else {"admit_window": args.admit_window}
    return trio_mlx.ActorTuning.from_env(**flags, **window)


def _ceilings(choice: str) -> tuple[str, ...]:
    return ("batchgenerator", "bare") if choice == "both" else (choice,)


def _footprint_from_files(model: str) -> dict[str, Any] | None:
    """The model's bytes from its safetensors headers (no MLX), or None where it has none here."""
    from .. import models
    from ._physical import footprint_from_files

    try:
        return footprint_from_files(models.resolve_model(model))
    except Exception as exc:  # a footprint is extra: a model it cannot read still benchmarks
        print(f"note: no model bytes for the physical limit ({exc})", file=sys.stderr)
        return None


def _physical_record(args: argparse.Namespace, fp: dict[str, Any] | None, device_name: str | None) -> dict[str, Any]:
    """`physical` of the results: the model's footprint and the bandwidth, from --bandwidth-gbs
    or the table of known devices by MLX's device name (None where neither says)."""
    from ._physical import known_bandwidth

    known = known_bandwidth(device_name)
    gbs = args.bandwidth_gbs if args.bandwidth_gbs is not None else known
    source = "--bandwidth-gbs" if args.bandwidth_gbs is not None else "device table" if known else None
    return {**(fp or {}), "bandwidth_gbs": gbs, "bandwidth_source": source, "device_name": device_name}


def _run_paired(
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
        cache_limit_gb=trio_mlx.ActorTuning.from_env().cache_limit_gb, trace=os.environ.get(CEILING_TRACE_ENV), **settings)  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())
