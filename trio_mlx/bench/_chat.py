"""`trio-mlx bench chat`: multi-turn conversations, the load of chat clients and agents.

Each level runs `conversations` clients at once; each client holds one
conversation of `--turns` turns and resends the whole of it every turn: the
system prompt all clients share (`--system-words`), then its own history
(every earlier user turn and the assistant's streamed answer), then a new user
turn (`--user-words`). A server with a prompt cache prefills only what is new;
one without prefills everything, every turn. After its last turn each client
sends one fresh request holding only a new user turn: the time to first token
that a cache hit is judged against.

Per turn it reports the time to first token (p50, p90, mean), the prompt's
tokens and the cached ones (`usage.prompt_tokens_details.cached_tokens`, where
the server reports them), and per level the output tokens/s, every failed
request by reason, and `last_vs_fresh`: the last turn's median TTFT over the
fresh requests' (a prompt cache that works keeps it near 1 however long the
conversation). `by_request` lists every request: its conversation and turn, when
it was sent (`time.perf_counter()`: on the server's host, the clock of its step
and request traces, `--step-trace`), its TTFT and end, and its tokens.
`--warmup` requests go first, unmeasured (a server that loads its model or
compiles kernels on its first request pays that there). Texts are random words from a seeded generator, so the
same seed sends the same conversations to every server; the assistant's
answers are whatever the server streams, resent as they came (as clients do).
Any OpenAI-compatible chat endpoint works: trio_mlx (cache on or off) and
mlx_lm.server side by side. `trio-mlx bench chat plot A.json [B.json ...] -o
out.png` draws the runs' median TTFT per turn, one panel per level.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._http import SSEReader, categorize, dumps
from ._stats import RequestRecord

SCHEMA = "trio-mlx-bench-chat/1"
_PATH = "/v1/chat/completions"


class _ChatReader(SSEReader):
    """An SSEReader that also keeps the answer's text and the usage's cached tokens."""

    __slots__ = ("text", "prompt_tokens", "cached_tokens")

    def __init__(self, rec: RequestRecord):
        super().__init__(rec)
        self.text: list[str] = []
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> None:
        lines = (self.buf + data).split(b"\n")[:-1]
        super().feed(data, now)
        for line in lines:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            for ch in obj.get("choices") or ():
                content = (ch.get("delta") or {}).get("content")
                if content:
                    self.text.append(content)
            if usage := obj.get("usage"):
                self.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                self.cached_tokens = details.get("cached_tokens")


@dataclass
class Turn:
    """One request of one conversation, as measured."""

    turn: int  # 0-based; -1: the fresh request after the conversation
    sent: float = 0.0  # time.perf_counter() as it was sent: on one host, the server's traces' clock
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    message: str | None = None


@dataclass
class Conversation:
    system: str
    users: list[str]
    fresh: str
    turns: list[Turn] = field(default_factory=list)


def _words(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(n))


def make_conversations(n: int, turns: int, system_words: int, user_words: int, seed: int) -> list[Conversation]:
    """`n` conversations sharing one system prompt, each with its own user turns."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + _words(rng, system_words)
    return [Conversation(system, [_words(rng, user_words) for _ in range(turns)], _words(rng, user_words))
            for _ in range(n)]


async def _request(client: Any, messages: list[dict[str, str]], args: argparse.Namespace, model: str,
                   turn: int) -> tuple[Turn, str]:
    import trio

    body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    rec = RequestRecord()
    reader = _ChatReader(rec)
    t0 = time.perf_counter()
    try:
        with trio.fail_after(args.timeout):
            await client.stream(_PATH, dumps(body), reader.feed, t0)
        rec.e2e = time.perf_counter() - t0
    except Exception as exc:
        rec.error = categorize(exc)
        rec.message = f"{type(exc).__name__}: {exc}"[:300]
    rec.output_tokens = reader.usage_tokens if reader.usage_tokens is not None else rec.events
    if rec.error is None and not reader.done:
        rec.error, rec.message = "incomplete", "the stream ended without data: [DONE]"
    out = Turn(turn, t0, rec.ttft, rec.e2e, rec.output_tokens, reader.prompt_tokens, reader.cached_tokens,
               rec.error, rec.message)
    return out, "".join(reader.text)


async def run_conversation(client: Any, conv: Conversation, args: argparse.Namespace, model: str) -> None:
    messages = [{"role": "system", "content": conv.system}]
    for i, user in enumerate(conv.users):
        messages.append({"role": "user", "content": user})
        turn, answer = await _request(client, messages, args, model, i)
        conv.turns.append(turn)
        if turn.error:
            return  # a conversation whose turn failed cannot go on as a client's would
        messages.append({"role": "assistant", "content": answer})
    fresh, _ = await _request(client, [{"role": "user", "content": conv.fresh}], args, model, -1)
    conv.turns.append(fresh)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "mean": None}
    s = sorted(values)
    return {"p50": 1e3 * s[len(s) // 2], "p90": 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))],
            "mean": 1e3 * statistics.fmean(s)}


def level_stats(convs: Sequence[Conversation], duration: float, turns: int) -> dict[str, Any]:
    """Per-turn TTFT and token figures of one level, and its totals."""
    by_turn: list[dict[str, Any]] = []
    everything = [t for c in convs for t in c.turns]
    for i in [*range(turns), -1]:
        ok = [t for c in convs for t in c.turns if t.turn == i and t.error is None]
        prompt = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
        cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
        by_turn.append({
            "turn": "fresh" if i < 0 else i + 1,
            "requests": len(ok),
            "ttft_ms": _ms([t.ttft for t in ok if t.ttft is not None]),
            "prompt_tokens": statistics.fmean(prompt) if prompt else None,
            "cached_tokens": statistics.fmean(cached) if cached else None,
        })
    errors: dict[str, int] = {}
    for t in everything:
        if t.error:
            errors[t.error] = errors.get(t.error, 0) + 1
    tokens = sum(t.output_tokens for t in everything)
    last, fresh = by_turn[turns - 1]["ttft_ms"]["p50"], by_turn[-1]["ttft_ms"]["p50"]
    by_request = [{"conversation": k, "turn": "fresh" if t.turn < 0 else t.turn + 1, "sent": t.sent,
                   "ttft_s": t.ttft, "e2e_s": t.e2e, "prompt_tokens": t.prompt_tokens,
                   "cached_tokens": t.cached_tokens, "error": t.error}
                  for k, c in enumerate(convs) for t in c.turns]
    return {"conversations": len(convs), "requests": len(everything), "duration_s": duration,
            "output_tokens": tokens, "output_throughput": tokens / duration if duration else 0.0,
            "last_vs_fresh": last / fresh if last and fresh else None,
            "errors": {"total": sum(errors.values()), "by_reason": errors}, "turns": by_turn,
            "by_request": by_request}


async def run_levels(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    import trio

    from ._http import HttpxClient, RawClient

    peak = max(args.conversations)
    client: Any = HttpxClient(args.url, peak, args.timeout) if args.client == "httpx" else RawClient(args.url)
    try:
        model = args.served_model_name
        if not model:
            data = (await client.get_json("/v1/models")).get("data") or []
            if not data:
                raise SystemExit("trio-mlx bench chat: the server lists no model; pass --served-model-name")
            model = str(data[0]["id"])
        for i in range(args.warmup):  # unmeasured; distinct from every conversation's text
            rng = random.Random(10**6 + i)
            await _request(client, [{"role": "user", "content": _words(rng, args.user_words)}], args, model, -1)
        levels = []
        for k, n in enumerate(args.conversations):
            convs = make_conversations(n, args.turns, args.system_words, args.user_words, args.seed + k)
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for conv in convs:
                    nursery.start_soon(run_conversation, client, conv, args, model)
            lv = level_stats(convs, time.perf_counter() - t0, args.turns)
            levels.append(lv)
            if not args.quiet:
                print(format_level(lv), file=sys.stderr)
        return model, levels
    finally:
        await client.aclose()


def format_level(lv: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    ratio = lv.get("last_vs_fresh")
    lines = [f"{lv['conversations']} conversations: {lv['output_throughput']:.1f} tok/s, "
             f"{lv['errors']['total']} errors {lv['errors']['by_reason'] or ''}"
             + (f", last turn / fresh TTFT {ratio:.2f}x" if ratio else ""),
             "| turn | TTFT p50 ms | TTFT p90 ms | prompt tokens | cached tokens |",
             "|---|---|---|---|---|"]
    for t in lv["turns"]:
        lines.append(f"| {t['turn']} | {f(t['ttft_ms']['p50'])} | {f(t['ttft_ms']['p90'])} | "
                     f"{f(t['prompt_tokens'])} | {f(t['cached_tokens'])} |")
    return "\n".join(lines) + "\n"


def write_plot(results: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Median TTFT per turn of each run (`--out` JSONs), one panel per level of conversations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({lv["conversations"] for res in results for lv in res["levels"]})
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 4), squeeze=False)
    for ax, n in zip(axes[0], levels, strict=True):
        for res in results:
            for lv in res["levels"]:
                if lv["conversations"] != n:
                    continue
                turns = [t for t in lv["turns"] if t["ttft_ms"]["p50"] is not None]
                ax.plot([str(t["turn"]) for t in turns], [t["ttft_ms"]["p50"] for t in turns], marker="o",
                        label=res.get("label") or res.get("url"))
        ax.set_title(f"{n} conversation{'s' if n > 1 else ''} at once")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(prog="trio-mlx bench chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--conversations", type=ints, default=[1, 8], help="levels: conversations at once (1,8,32)")
    p.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    p.add_argument("--system-words", type=int, default=1500, help="words of the shared system prompt")
    p.add_argument("--user-words", type=int, default=40, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--served-model-name", help="the model id to send (default: the server's first)")
    p.add_argument("--client", choices=["raw", "httpx"], default="raw")
    p.add_argument("--label", help="the run's name in tables")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str]) -> int:
    import trio

    if argv and argv[0] == "plot":
        p = argparse.ArgumentParser(prog="trio-mlx bench chat plot", description=write_plot.__doc__)
        p.add_argument("results", nargs="+", help="result JSON files of `trio-mlx bench chat --out`")
        p.add_argument("-o", "--out", required=True, help="PNG to write")
        a = p.parse_args(argv[1:])
        print(write_plot([json.loads(Path(r).read_text()) for r in a.results], a.out))
        return 0
    args = _parser().parse_args(argv)
    if args.turns < 1 or not args.conversations or min(args.conversations) < 1 or args.warmup < 0:
        raise SystemExit("trio-mlx bench chat: --turns and every --conversations level must be >= 1, "
                         "--warmup >= 0")
    model, levels = trio.run(run_levels, args)
    result = {"schema": SCHEMA, "label": args.label or args.url, "url": args.url, "model": model,
              "settings": {k: getattr(args, k) for k in ("turns", "system_words", "user_words",
                                                          "max_tokens", "temperature", "seed", "warmup")},
              "levels": levels}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if sum(lv["errors"]["total"] for lv in levels) else 0
