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
traces level by level (`_trace.py`); `trio-mlx bench compare` starts servers
one after another in alternating rounds and runs this bench against each
(`_compare.py`).

This module owns the command line: it reads the flags, plans the levels, makes the
prompts (`_prompts.py`), hands them to the target (`_sweep.py` for a server, `_limit.py`,
`_engine.py`) and writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio_mlx

from ..engine import freeze_heap
from ._prompts import load_tokenizer, make_prompts, model_from_server, request_lengths
from ._stats import format_table, load_results, write_plot
from ._sweep import print_level, run_http, run_paired

SCHEMA = "trio-mlx-bench/1"
LIMIT_WARMUP = 4  # sequences in --limit's warm-up batch: arbitrary, just small


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
        "       %(prog)s trace SERVER_TRACE [CEILING_TRACE]\n"
        "       %(prog)s compare --out DIR --side NAME=COMMAND --side NAME=COMMAND [...] -- [chat] BENCH_ARGS...",
        description="Load-test an OpenAI-compatible endpoint (--url) or the raw ceilings "
        "(--limit: mlx_lm's BatchGenerator and MLX's bare pipelined forward). Also: `trio-mlx bench plot A.json [B.json ...] -o out.png` and "
        "`trio-mlx bench table A.json [B.json ...] [--ceiling C.json]`; multi-turn conversations "
        "with a shared system prompt (the prompt cache's load): `trio-mlx bench chat --url URL`; "
        "step traces (TRIO_MLX_STEP_TRACE) read level by level: `trio-mlx bench trace SERVER_TRACE "
        "[CEILING_TRACE]`; servers side by side, each started and loaded in turn in rounds of "
        "alternating order: `trio-mlx bench compare --out DIR --side NAME=COMMAND ... -- BENCH_ARGS`.",
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
    p.add_argument("--max-tokens-spread", type=float, default=0.0, metavar="R",
                   help="each request's max_tokens drawn uniformly from MAX_TOKENS x [1-R, 1+R] (seeded by "
                   "--seed; 0 <= R < 1; default 0: all alike), so that requests end apart as served "
                   "traffic's do instead of in waves; not with --limit or --paired")  # fmt: skip
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
                     "c rows over plain KV caches), or both (default); with --paired, the one it "
                     "interleaves (default: the BatchGenerator; bare: waves of c rows, one after another)")  # fmt: skip
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
    if argv and argv[0] == "compare":
        from ._compare import main as compare_main

        return compare_main(argv[1:], main)
    args = _parser().parse_args(argv)
    if (args.limit or args.engine or args.paired) and args.rate:
        raise SystemExit("trio-mlx bench: --limit/--engine/--paired run the closed loop only (use --concurrency)")
    if args.paired_rounds < 1:
        raise SystemExit("trio-mlx bench: --paired-rounds must be at least 1")
    if args.paired and not args.url:
        raise SystemExit("trio-mlx bench: --paired pairs a server (--url) with the ceiling")
    if args.ceiling != "both" and not (args.limit or args.paired):
        raise SystemExit("trio-mlx bench: --ceiling picks what --limit or --paired measures")
    if args.paired and args.ceiling == "both":
        args.ceiling = "batchgenerator"  # --paired interleaves one ceiling with the server
    if not 0 <= args.max_tokens_spread < 1:
        raise SystemExit("trio-mlx bench: --max-tokens-spread is in [0, 1)")
    if args.max_tokens_spread and (args.limit or args.paired):
        raise SystemExit("trio-mlx bench: --max-tokens-spread is for --engine and --url: the ceilings give every row "
                         "--max-tokens")
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
        "max_tokens_spread": args.max_tokens_spread,
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
        print_level(lv, args)
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
            lengths=request_lengths(total, args.max_tokens, args.max_tokens_spread, seed=args.seed),
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
            result["levels"] = run_paired(args, plan, prompts, warm, result)
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


if __name__ == "__main__":
    sys.exit(main())
