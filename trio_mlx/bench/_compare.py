"""`trio-mlx bench compare`: servers side by side, each started, loaded and stopped in turn, in
rounds of alternating order.

    trio-mlx bench compare --out DIR --side NAME=COMMAND --side NAME=COMMAND [...]
        [--rounds R] [--side-args NAME=ARGS] -- [chat] BENCH_ARGS...

A host's speed drifts by tens of percent within minutes (BENCHMARKS.md, "Method"), so two
servers measured one after the other say as much about the moment as about the servers. Each
round starts every side's server in turn, loads it, and stops it before the next starts: odd
rounds in the order given, even rounds the other way round (A B, B A, ...), so that a host
that speeds up or slows down steadily weighs on every side alike.

- COMMAND starts one server, split as a shell splits words: leading `VAR=VALUE` words set its
  environment, and `{port}`, `{out}` and `{run}` stand for its port (a free one, chosen per
  run), DIR and the run's name (`NAME-ROUND`: a step trace of its own,
  `TRIO_MLX_STEP_TRACE={out}/trace-{run}.tsv`). It runs in a process group of its own, its
  output in DIR/RUN.log; it is ready when `GET /ready` answers 200 (`GET /health`, where the
  server has no `/ready`: mlx_lm.server), and stopped with SIGTERM (then SIGKILL to its
  group, after `--grace` seconds if it is still there).
- The load is `trio-mlx bench BENCH_ARGS` against it (`--url`, `--label RUN`, `--out
  DIR/RUN.json` and `--server-pid` added), or `trio-mlx bench chat ...` when BENCH_ARGS start
  with `chat`; the same for every side, plus that side's `--side-args`.
- DIR/summary.md (also printed) puts the sides side by side level by level: output tok/s of
  each round and the ratio of their sum to the first side's; TTFT and TPOT p50; the server's
  CPU per token, whole and its main thread's (the event loop's); for chat runs, TTFT p50 of
  the last turn and of the fresh requests. `trio-mlx bench table`, `plot` and `chat plot`
  read the runs' JSON files as they read any.

Exits non-zero if a server failed to start or a run had errors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_.]+")  # a side's name: part of file names, no '-' (NAME-ROUND)
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True, slots=True)
class Side:
    name: str
    command: str  # the server's command line, placeholders and all
    bench_args: tuple[str, ...] = ()  # its own `--side-args`


def order(sides: Sequence[Side], rounds: int) -> list[tuple[int, Side]]:
    """(round, side) of every run, in the order they run: odd rounds as given, even reversed."""
    return [(r, side) for r in range(1, rounds + 1) for side in (sides if r % 2 else sides[::-1])]


def server_command(command: str, port: int, out: Path, run: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of a side's COMMAND for one run."""
    for key, value in (("{port}", str(port)), ("{out}", str(out)), ("{run}", run)):
        command = command.replace(key, value)
    words = shlex.split(command)
    env: dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise SystemExit(f"trio-mlx bench compare: no command in {command!r}")
    return env, words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Until `GET /ready` answers 200 (or `/health`, where there is no /ready); False if the
    process exits or `timeout` seconds pass first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        for path in ("/ready", "/health"):
            try:
                status = httpx.get(url + path, timeout=2.0).status_code
            except httpx.HTTPError:
                break  # not listening yet
            if status == 200:
                return True
            if status != 404:
                break  # it has the path and says: not yet
        time.sleep(0.25)
    return False


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the server (which stops its own children: a process actor), then SIGKILL to
    its whole process group: at once if the server is gone, else once `grace` seconds pass."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived the server
    except ProcessLookupError:
        pass  # the group is gone
    proc.wait()


Bench = Callable[[list[str]], int]  # `trio-mlx bench ARGS` in this process: `_cli.main`


def _load(bench: Bench, args: list[str]) -> int:
    """One load's exit status."""
    try:
        return bench(args)
    except SystemExit as exc:  # a bad flag, or a server the bench could not read
        print(f"trio-mlx bench {shlex.join(args)}: {exc}", file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 2


def run_one(side: Side, run: str, out: Path, load: Bench, bench: list[str], grace: float,
            start_timeout: float) -> str | None:
    """Start `side`'s server, load it, stop it; None if it served, else what went wrong."""
    port = free_port()
    env, argv = server_command(side.command, port, out, run)
    url = f"http://127.0.0.1:{port}"
    chat = bool(bench) and bench[0] == "chat"
    (out / f"{run}.json").unlink(missing_ok=True)  # an earlier call's, into the same DIR
    with open(out / f"{run}.log", "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                    start_new_session=True)
        except OSError as exc:
            return f"could not start {argv[0]}: {exc}"
        try:
            if not wait_ready(url, proc, start_timeout):
                return f"not ready (exit status {proc.poll()}; see {run}.log)"
            extra = ["--url", url, "--label", run, "--out", str(out / f"{run}.json")]
            if not chat and "--server-pid" not in bench:
                extra += ["--server-pid", str(proc.pid)]
            status = _load(load, [*bench, *side.bench_args, *extra])
            return None if status == 0 else f"the bench exited {status}"
        finally:
            stop(proc, grace)


# ------------------------------------------------------------------------------- the summary


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _level_key(lv: dict[str, Any]) -> str:
    if "conversations" in lv:
        return f"conversations={lv['conversations']}"
    return f"c={lv['concurrency']}" if lv.get("concurrency") is not None else f"rate={lv['rate']}/s"


def summary(sides: Sequence[Side], runs: Sequence[tuple[int, Side]], out: Path,
            failed: dict[str, str]) -> str:
    """The runs' figures side by side (DIR/summary.md)."""
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}  # a side's runs, by round
    for r, side in sorted(runs, key=lambda rs: rs[0]):
        path = out / f"{side.name}-{r}.json"
        results[side.name].append(json.loads(path.read_text()) if path.exists() else {"levels": []})
    levels: dict[str, dict[str, list[dict[str, Any]]]] = {}  # level -> side -> its level in each round
    for name, rounds in results.items():
        for res in rounds:
            for lv in res.get("levels", []):
                levels.setdefault(_level_key(lv), {}).setdefault(name, []).append(lv)
    names = [s.name for s in sides]
    chat = any("conversations" in lv for by_side in levels.values() for lvs in by_side.values() for lv in lvs)
    first = names[0]
    out_lines = [f"# {' / '.join(names)}: {max(r for r, _ in runs)} round(s), in the order "
                 + ", ".join(f"{s.name}-{r}" for r, s in runs) + "\n"]

    def table(title: str, cell: Callable[[str, list[dict[str, Any]], list[dict[str, Any]]], str]) -> None:
        out_lines.append(f"## {title}\n")
        out_lines.append("| level | " + " | ".join(names) + " |")
        out_lines.append("|---|" + "---|" * len(names))
        for key, by_side in levels.items():
            base = by_side.get(first, [])
            out_lines.append(f"| {key} | " + " | ".join(cell(n, by_side.get(n, []), base) for n in names) + " |")
        out_lines.append("")

    def throughput(name: str, lvs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
        if not lvs:
            return "-"
        text = " / ".join(_fmt(lv["output_throughput"]) for lv in lvs)
        mine = sum(lv["output_throughput"] or 0 for lv in lvs)
        theirs = sum(lv["output_throughput"] or 0 for lv in base)
        if name != first and theirs:
            text += f" (x{mine / theirs:.2f})"
        errors = sum(lv["errors"]["total"] for lv in lvs)
        return text + (f", {errors} errors" if errors else "")

    table(f"Output tok/s, each round (x: the sum's ratio to {first}'s)", throughput)
    if chat:
        def turns(name: str, lvs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
            # a level's turns end with the fresh requests' row
            return ", ".join(f"{_fmt(lv['turns'][-2]['ttft_ms']['p50'])} / {_fmt(lv['turns'][-1]['ttft_ms']['p50'])}"
                             for lv in lvs if len(lv["turns"]) >= 2) or "-"

        table("TTFT p50 ms, last turn / fresh requests, each round", turns)
    else:
        def latency(name: str, lvs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
            return ", ".join(f"{_fmt(lv['ttft_ms']['p50'])} / {_fmt(lv['tpot_ms']['p50'], '.1f')}"
                             for lv in lvs) or "-"

        table("TTFT p50 / TPOT p50 ms, each round", latency)

        def cpu(name: str, lvs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
            whole = [x for lv in lvs if (x := lv.get("server_cpu_us_per_token")) is not None]
            loop = [x for lv in lvs if (x := lv.get("server_main_thread_cpu_us_per_token")) is not None]
            return f"{statistics.median(whole):,.0f} / {statistics.median(loop):,.0f}" if whole and loop else "-"

        if any(lv.get("server_cpu_us_per_token") is not None
               for by_side in levels.values() for lvs in by_side.values() for lv in lvs):
            table("The server's CPU us per output token, whole / main thread (median of the rounds)", cpu)
    for run, why in failed.items():
        out_lines.append(f"- {run}: {why}")
    return "\n".join(out_lines).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trio-mlx bench compare",
        usage="%(prog)s --out DIR --side NAME=COMMAND --side NAME=COMMAND [...] [options] -- [chat] BENCH_ARGS...",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Example: trio-mlx bench compare --out ab --rounds 2 "
        "--side 'thread=trio-mlx serve --model M --port {port}' "
        "--side 'process=trio-mlx serve --model M --port {port} --actor process' "
        "-- --model M --concurrency 64,256 --requests-multiple 4",
    )
    p.add_argument("--out", required=True, help="folder for every run's JSON and log, and summary.md")
    p.add_argument("--side", action="append", required=True, metavar="NAME=COMMAND",
                   help="a server to compare: its name and the command that starts it ({port}, {out}, "
                   "{run} replaced; leading VAR=VALUE words: its environment); two or more")  # fmt: skip
    p.add_argument("--side-args", action="append", default=[], metavar="NAME=ARGS",
                   help="bench arguments for that side alone (e.g. --served-model-name for mlx_lm.server)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each side once a round (default 2)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to be ready (a first start on a GPU compiles kernels)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    return p


def _named(text: str, flag: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not _NAME.fullmatch(name) or not value.strip():
        raise SystemExit(f"trio-mlx bench compare: {flag} takes NAME=VALUE (NAME of letters, digits, "
                         f"'_' and '.'), got {text!r}")
    return name, value


def main(argv: list[str], bench_main: Bench) -> int:
    """`trio-mlx bench compare ARGV`, each load run by `bench_main` (`_cli.main`, which calls this)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:cut])
    bench = argv[cut + 1:]
    commands = dict(_named(s, "--side") for s in args.side)
    if len(commands) < 2 or len(commands) != len(args.side):
        raise SystemExit("trio-mlx bench compare: give two or more --side, each NAME once")
    extra = {name: tuple(shlex.split(value)) for name, value in (_named(s, "--side-args") for s in args.side_args)}
    if unknown := set(extra) - set(commands):
        raise SystemExit(f"trio-mlx bench compare: --side-args for no --side: {sorted(unknown)}")
    if args.rounds < 1:
        raise SystemExit("trio-mlx bench compare: --rounds must be at least 1")
    for flag in ("--url", "--out", "--label"):
        if flag in bench:
            raise SystemExit(f"trio-mlx bench compare: {flag} is set per run; leave it out of BENCH_ARGS")
    sides = [Side(name, command, extra.get(name, ())) for name, command in commands.items()]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = order(sides, args.rounds)
    failed: dict[str, str] = {}
    for r, side in runs:
        run = f"{side.name}-{r}"
        print(f"trio-mlx bench compare: {run}", file=sys.stderr, flush=True)
        if (why := run_one(side, run, out, bench_main, bench, args.grace, args.start_timeout)) is not None:
            failed[run] = why
            print(f"trio-mlx bench compare: {run}: {why}", file=sys.stderr, flush=True)
    text = summary(sides, runs, out, failed)
    (out / "summary.md").write_text(text)
    sys.stdout.write(text)
    return 1 if failed else 0
