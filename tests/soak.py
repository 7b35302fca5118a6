"""Soak: thousands of requests against a real server process, many from clients that misbehave.

    python tests/soak.py --requests 2000 --concurrency 32 [--model DIR] [--seed 1] [--json OUT]

Starts `trio-mlx serve` on 127.0.0.1 (port 0) with the tiny random-weight model
(built in a temp dir unless --model names one; with --hostile, one whose
template renders tools, as a --model given should), a small batch so requests
queue, small prefill chunks so long prompts spend several steps in prefill,
and a short stall timeout. A warm-up phase and then the soak phase run the
same mix of clients:

- well-behaved (~55%): chat or text, streamed or not, n 1 or 2; every answer is
  checked whole: status, framing ([DONE] last), finish_reason, usage, and the
  greedy answers to a few fixed prompts must be identical every time;
- hang-ups (~30%) at a random moment: right after sending (queued behind a
  full batch), a few ms into a long prompt (prefill), or after some streamed
  events (decode);
- stalled readers (~10%): big chunks, a tiny receive buffer, no reading for a
  few seconds; the server's stall timeout must reap them: when the client
  reads again, the stream is cut (no [DONE]) and the connection closed;
- invalid bodies (~5%): each must get a 4xx in OpenAI's error shape.

Afterwards, through /metrics: nothing queued, active or streaming; no 5xx; the
4xx count equals the invalid bodies sent; one stall abort per stalled reader;
aborts by stage and cause reported. The server's log must hold no ERROR, no
traceback, and no WARNING but the expected stall notices. Its resident memory
(RSS, less MLX's buffer cache: freed buffers kept for reuse, which swing by
several MB with the shapes last used) after the soak must be within
--rss-tolerance of its level after the warm-up; it is also read after each
part of the soak (--rss-samples): a leak climbs steadily, an allocator
settling does not. MLX's own memory in use once idle (weights, and anything
a finished or aborted request left behind: a KV cache, a sampler's state),
less what the prompt cache holds on purpose (`trio_mlx_prompt_cache_bytes`;
both readings leave it out), is exact, so it must come back to its warm-up level within --mlx-tolerance
(1 MiB: a tiny model's KV cache alone is 128 KB a sequence). Exact because the soak's server
runs with MLX's buffer cache off (`--cache-limit-gb 0`): with it on, MLX hands a new array a
freed block up to two pages larger than asked and counts the whole block in use, so each
prompt-cache entry of the tiny model (arrays of 17-50 KB) held up to ~30% more than its bytes,
~0.5-1.3 MB over ~300 entries: the check failed about one run in eight
(benchmarks/2026-11-30-cpu/cache-memory/). `run()` returns the report (`report["failures"]` is empty
when all held); `main()` prints it as JSON and exits 1 on any failure.

`--hostile` mixes attacks into the same soak, against a process actor, each
from a few percent of the clients (`--huge`, `--slow-body`, ...: their shares),
each with the answer it must get:

- huge prompts (1-4 MB of text): 400 `context_length_exceeded`;
- slow bodies (sent in pieces, answered whole; or never finished: 408 after
  `--body-timeout`);
- grammar bombs (`--grammar-bomb`, keep it rare: each holds a grammar worker,
  a core, for the check's 5 s bound): a JSON schema whose string has an
  `allOf` of 20-22 patterns `.*a.*`, new to the server each time, on chat or
  completions: 400 naming `response_format`;
- tool text (`--tool-text`): 1, 4 or 15 MB in a tool's description or a
  call's arguments, on chat, Anthropic's messages or Responses: 400 in that
  API's shape (`context_length_exceeded`, or Anthropic's "prompt is too long");
- count_tokens (`--count-tokens`): 1-15 MB in a message or a tool of
  `/v1/messages/count_tokens`: 400 in Anthropic's shape;
- token ids (`--token-ids`): 1-5 million ids on `/v1/completions`, bare or a
  list of one: 400 `context_length_exceeded` naming the count;
- n=4 readers that stop reading (`--n-stall`): cut as stalled (by the unread
  cap over all choices, `--max-unread-tokens`, or the stall timeout), no
  `[DONE]`, four stall aborts (every choice);
- ambiguous framing (`--framing`): Content-Length and Transfer-Encoding, a
  request pipelined behind, over a raw socket: one 400 `invalid_framing`, the
  connection closed, the pipelined request not served;
- `--kill-actor N` SIGKILLs of the actor process mid-soak.

Requests in flight at a kill end with an error (counted `cut_by_kill`,
deliberately cut); well-behaved clients retry the 503 (`Retry-After`) the
server answers while the new actor loads; every other request must be served
whole (0 lost), the server must be ready again within `--restart-within`
seconds of each kill, and its memory must come back as in the plain soak.

Throughout the mix (warm-up and soak, plain or hostile) a monitor polls
`/health` every `--health-interval` seconds on a fresh connection: every answer
must be 200 (a "stalled" 503 while the server works would be false) and the
p99 of its latency under `--health-p99` seconds; the report gives its p50, p99
and max.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

ROOT = Path(__file__).resolve().parents[1]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT_TOKENS, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
SERVED = "soak"  # with --hostile, the model's name (`--model-name`): Anthropic's API names it in every request
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY_PROMPTS = ("The quick brown fox", "Once upon a time", "In the beginning", "Soak test")
GREEDY_TOKENS = 24
VOCAB = range(5, 500)  # token ids the tiny model has (vocab 512), clear of its special ids
# All the server may log at WARNING or above during a soak; anything else fails it: a stalled
# reader cut by the stall timeout, or (with --hostile) by the unread cap; a grammar bomb refused.
EXPECTED_WARNING = re.compile(r"the client took no data for .* aborting it|the client is \d+ tokens behind; aborting it"
                              r"|grammar check refused \(response_format\): checking it took")
# With --hostile, the actor kills' own lines: the death, and each request it ended.
EXPECTED_KILL_LINE = re.compile(r"the GPU actor died \(ActorProcessError: the actor process exited with signal 9\)"
                                r"|failed on the engine: the GPU actor died")
INVALID: list[tuple[str, bytes, str]] = [
    (CHAT, b'{"messages": [', "application/json"),
    (TEXT, b'{"prompt": "\xff\xfe"}', "application/json"),
    (TEXT, b'{"prompt": "hi"}', "text/plain"),
    (TEXT, b'{"prompt": 5}', "application/json"),
    (TEXT, b'{"prompt": "hi", "max_tokens": 1000000000000}', "application/json"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', "application/json"),
    (TEXT, b'{"prompt": "hi", "logit_bias": {"not-a-token": 1}}', "application/json"),
    (CHAT, b'{"messages": []}', "application/json"),
    (CHAT, b'{"messages": [{"role": "robot", "content": "x"}]}', "application/json"),
    (TEXT, b"[" * 5000 + b"]" * 5000, "application/json"),
]


@dataclass
class Options:
    requests: int = 2000
    concurrency: int = 32
    warmup: int = 0  # 0: a tenth of the requests, at least 100
    model: str | None = None
    seed: int = 1
    hangup: float = 0.30
    stall: float = 0.10
    invalid: float = 0.05
    stall_timeout: float = 0.5
    stall_hold: float = 0.0  # seconds a stalled reader stops reading; 0: max(3, 6 x stall_timeout)
    max_batch: int = 8
    rss_tolerance: float = 0.05
    mlx_tolerance: int = 1 << 20  # bytes MLX's memory in use, idle, may grow from the warm-up to the end
    rss_samples: int = 4  # RSS is read after the warm-up and after each of this many parts of the soak
    deadline: float = 900.0  # seconds the whole soak may take: it always stops by itself
    access_log: bool = False
    server_log: str | None = None  # also write the server's log to this file
    hostile: bool = False  # mix in huge prompts, slow bodies and actor kills (a process actor)
    huge: float = 0.04  # with --hostile: share of clients sending a prompt of megabytes
    slow_body: float = 0.06  # with --hostile: share sending their body slowly (a third never finish)
    kill_actor: int = 1  # with --hostile: SIGKILLs of the actor process during the soak
    body_timeout: float = 5.0  # with --hostile: the server's --body-timeout
    restart_within: float = 20.0  # with --hostile: seconds a killed actor may take to serve again
    grammar_bomb: float = 0.01  # with --hostile: share sending a JSON schema whose check never ends (5 s each)
    tool_text: float = 0.02  # with --hostile: share sending megabytes of tool description or call arguments
    count_tokens: float = 0.015  # with --hostile: share asking /v1/messages/count_tokens about megabytes
    token_ids: float = 0.015  # with --hostile: share sending a /v1/completions prompt of millions of ids
    n_stall: float = 0.02  # with --hostile: share of n=4 streaming readers that stop reading
    framing: float = 0.02  # with --hostile: share sending Content-Length and Transfer-Encoding, pipelined
    max_unread_tokens: int = 256  # with --hostile: the server's --max-unread-tokens (its default: 2048)
    health_interval: float = 0.05  # seconds between /health polls during the mix (0: none)
    health_p99: float = 2.0  # seconds /health's p99 latency during the mix must stay under


@dataclass
class Tally:
    """What the clients saw."""

    planned: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    greedy: dict[str, set[str]] = field(default_factory=dict)
    chat_prompt_tokens: set[int] = field(default_factory=set)
    kills: Kills | None = None  # with --hostile: when the actor was killed and when it served again
    counted_4xx: int = 0  # attacks refused with a 4xx on /v1/chat/completions or /v1/completions (in /metrics)
    attack_seconds: dict[str, list[float]] = field(default_factory=dict)  # how long each attack's refusal took

    def refused(self, kind: str, path: str, seconds: float) -> None:
        self.outcomes[f"{kind}_rejected"] += 1
        self.counted_4xx += path in (CHAT, TEXT)
        self.attack_seconds.setdefault(kind, []).append(seconds)

    def fail(self, what: str) -> None:
        self.outcomes["failed"] += 1
        if len(self.failures) < 30:
            self.failures.append(what[:500])


@dataclass
class Kills:
    """Actor kills: a request in flight at one may end with an error (deliberately cut)."""

    at: list[float] = field(default_factory=list)
    back: list[float] = field(default_factory=list)  # /ready 200 again

    def cut(self, started: float, ended: float) -> bool:
        """Whether a request that ran from `started` to `ended` met a kill or its restart."""
        for i, t in enumerate(self.at):
            back = self.back[i] if i < len(self.back) else math.inf
            if started <= back + 0.5 and ended >= t:
                return True
        return False

    def restarting(self) -> bool:
        return len(self.back) < len(self.at)


# ---- a minimal HTTP/1.1 client on trio sockets (h11): it can misbehave on purpose ----------------


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class Conn:
    def __init__(self, sock: trio.socket.SocketType):
        self.sock = sock
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Conn:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect(("127.0.0.1", port))
        return cls(sock)

    async def send(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> None:
        headers = [("Host", "127.0.0.1"), ("Content-Length", str(len(body))), ("Connection", "close")]
        if body:
            headers.append(("Content-Type", content_type))
        data = self.h11.send(h11.Request(method=method, target=path, headers=headers)) or b""
        data += (self.h11.send(h11.Data(data=body)) or b"") + (self.h11.send(h11.EndOfMessage()) or b"")
        view = memoryview(data)
        while view:
            view = view[await self.sock.send(view):]

    async def event(self) -> Any:
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            self.h11.receive_data(await self.sock.recv(65536))
        return event

    async def response(self) -> Response:
        head = await self.event()
        assert isinstance(head, h11.Response), head
        body = b""
        while not isinstance(event := await self.event(), h11.EndOfMessage):
            if isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the connection closed mid-body")
            body += event.data
        return Response(head.status_code, {k.decode().lower(): v.decode() for k, v in head.headers}, body)

    def close(self) -> None:
        self.sock.close()


async def fetch(port: int, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> Response:
    conn = await Conn.open(port)
    try:
        await conn.send(method, path, body, content_type)
        return await conn.response()
    finally:
        conn.close()


async def fetch_retrying(port: int, path: str, body: bytes, tally: Tally,
                         content_type: str = "application/json") -> Response:
    """A POST that, while a killed actor restarts, retries the 503 as a client should."""
    while True:
        started = trio.current_time()
        r = await fetch(port, "POST", path, body, content_type)
        if r.status == 503 and tally.kills is not None and (
                b"service_unavailable" in r.body or b"overloaded_error" in r.body) and (  # OpenAI's, Anthropic's
                tally.kills.restarting() or tally.kills.cut(started, trio.current_time())):
            # the judge holds 503s on chat and completions (in /metrics) to this count
            tally.outcomes["restarting_503" if path in (CHAT, TEXT) else "restarting_503_other_api"] += 1
            await trio.sleep(0.2)
            continue
        return r


def sse_data(body: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" as is); comments skipped."""
    assert body.endswith(b"\n\n"), body[-200:]
    out: list[Any] = []
    for event in body[:-2].split(b"\n\n"):
        if event.startswith(b":"):
            continue
        assert event.startswith(b"data: "), event[:200]
        payload = event[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# ---- the clients ------------------------------------------------------------------------------


def plan(opts: Options, count: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """`count` client behaviours, decided up front from the seed (so a run can be repeated)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for _ in range(count):
        x = rng.random()
        if x < opts.hangup:
            moment = rng.choices(("queued", "prefill", "decode"), (1, 1, 2))[0]
            out.append(("hangup", {"moment": moment, "stream": rng.random() < 0.6,
                                   "delay": rng.uniform(0.0, 0.01) if moment == "queued" else rng.uniform(0.05, 1.5),
                                   "events": rng.randint(1, 20), "prompt": [rng.choice(VOCAB) for _ in range(
                                       rng.randint(500, 900) if moment == "prefill" else rng.randint(3, 30))]}))
        elif x < opts.hangup + opts.stall:
            out.append(("stall", {}))
        elif x < opts.hangup + opts.stall + opts.invalid:
            out.append(("invalid", {"case": rng.randrange(len(INVALID))}))
        elif opts.hostile and (attack := hostile_attack(opts, x - opts.hangup - opts.stall - opts.invalid, rng)):
            out.append(attack)
        else:
            greedy = rng.random() < 0.25
            n = 2 if not greedy and rng.random() < 0.15 else 1
            out.append(("ok", {
                "chat": rng.random() < 0.5, "stream": rng.random() < 0.5, "n": n,
                "greedy": rng.choice(GREEDY_PROMPTS) if greedy else None,
                "max_tokens": GREEDY_TOKENS if greedy else rng.randint(1, 48),
                "temperature": rng.choice((0.0, 0.7, 1.0)),
                "seed": rng.randrange(2**32) if rng.random() < 0.3 else None,
                "prompt": [rng.choice(VOCAB) for _ in range(rng.randint(3, 60))],
            }))
    return out


def hostile_attack(opts: Options, x: float, rng: random.Random) -> tuple[str, dict[str, Any]] | None:
    """The attack of a client whose draw, past the plain mix's shares, is `x`; None: well-behaved."""
    shares = (("huge", opts.huge), ("slow_body", opts.slow_body), ("grammar_bomb", opts.grammar_bomb),
              ("tool_text", opts.tool_text), ("count_tokens", opts.count_tokens), ("token_ids", opts.token_ids),
              ("n_stall", opts.n_stall), ("framing", opts.framing))
    kind = None
    for name, share in shares:
        if x < share:
            kind = name
            break
        x -= share
    if kind is None:
        return None
    if kind == "huge":
        return kind, {"chars": rng.randint(1, 4) * 1_000_000, "chat": rng.random() < 0.7}
    if kind == "slow_body":
        return kind, {"finish": rng.random() < 0.67, "pieces": rng.randint(2, 6), "max_tokens": rng.randint(1, 24),
                      "prompt": [rng.choice(VOCAB) for _ in range(rng.randint(3, 60))]}
    if kind == "grammar_bomb":  # 20-22 of the 26 letters: each client's schema is new to the server
        return kind, {"letters": "".join(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(20, 22))),
                      "chat": rng.random() < 0.7}
    if kind == "tool_text":
        return kind, {"case": rng.choice(sorted(TOOL_TEXT)), "mb": rng.choice((1, 4, 15))}
    if kind == "count_tokens":
        return kind, {"in_tool": rng.random() < 0.5, "mb": rng.choice((1, 4, 15))}
    if kind == "token_ids":
        return kind, {"ids": rng.randint(1, 5) * 1_000_000, "nested": rng.random() < 0.5}
    if kind == "n_stall":
        return kind, {"chat": rng.random() < 0.5}
    return kind, {"pipelined": rng.choice(("GET /health", "POST"))}


def ok_body(p: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": p["max_tokens"], "ignore_eos": True, "n": p["n"]}
    if p["greedy"]:
        body["temperature"] = 0
    else:
        body["temperature"] = p["temperature"]
        if p["seed"] is not None:
            body["seed"] = p["seed"]
    if p["stream"]:
        body.update(stream=True, stream_options={"include_usage": True})
    if p["chat"]:
        content = p["greedy"] or HELLO[0]["content"]
        return CHAT, {**body, "messages": [{"role": "user", "content": content}]}
    return TEXT, {**body, "prompt": p["greedy"] or p["prompt"]}


async def well_behaved(port: int, p: dict[str, Any], tally: Tally) -> None:
    path, body = ok_body(p)
    where = f"{path} {json.dumps(body)[:200]}"
    started = trio.current_time()
    r = await fetch_retrying(port, path, dumps(body), tally)  # a 503 while the new actor loads: again
    if tally.kills is not None and tally.kills.cut(started, trio.current_time()) and (
            (r.status == 500 and b"generation_failed" in r.body)
            or (r.status == 200 and b'"code":"generation_failed"' in r.body.replace(b" ", b""))):
        tally.outcomes["cut_by_kill_500" if r.status == 500 else "cut_by_kill_stream"] += 1
        tally.outcomes["ok_cut_by_kill"] += 1
        return
    if r.status != 200:
        return tally.fail(f"{where}: HTTP {r.status} {r.body[:300]!r}")
    n, want = p["n"], p["max_tokens"]
    try:
        if p["stream"]:
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            events = sse_data(r.body)
            assert events[-1] == "[DONE]", events[-2:]
            usage = events[-2]["usage"]
            chunks = [e for e in events[:-2] if "choices" in e]
            assert len(chunks) == len(events) - 2, "an event that is not a chunk (an error?)"
            finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
            assert sorted(f["index"] for f in finishes) == list(range(n)), finishes
            assert all(f["finish_reason"] == "length" for f in finishes), finishes
            if p["chat"]:
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            else:
                text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            obj = json.loads(r.body)
            usage = obj["usage"]
            assert len(obj["choices"]) == n and all(c["finish_reason"] == "length" for c in obj["choices"])
            c0 = obj["choices"][0]
            text = c0["message"]["content"] if p["chat"] else c0["text"]
        assert usage["completion_tokens"] == n * want, (usage, n, want)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
        if not p["chat"] and not p["greedy"]:
            assert usage["prompt_tokens"] == len(p["prompt"]), usage
        if p["chat"] and not p["greedy"]:
            tally.chat_prompt_tokens.add(usage["prompt_tokens"])
    except (AssertionError, KeyError, IndexError, ValueError) as exc:
        return tally.fail(f"{where}: {type(exc).__name__}: {exc}")
    if p["greedy"]:
        tally.greedy.setdefault(f"{'chat' if p['chat'] else 'text'}: {p['greedy']}", set()).add(text)
    tally.completion_tokens += usage["completion_tokens"]
    tally.outcomes["completed"] += 1


async def hang_up(port: int, p: dict[str, Any], tally: Tally) -> None:
    """Send, then close the connection at the planned moment (the answer is never read whole)."""
    tokens = {"queued": 200, "prefill": 100, "decode": 400}[p["moment"]]  # prompt + tokens fit in 1024
    body: dict[str, Any] = {"prompt": p["prompt"], "max_tokens": tokens, "ignore_eos": True, "stream": p["stream"]}
    conn = await Conn.open(port)
    started = trio.current_time()
    try:
        await conn.send("POST", TEXT, dumps(body))
        if p["moment"] == "decode" and p["stream"]:
            seen = 0
            head = await conn.event()
            if tally.kills is not None and tally.kills.cut(started, trio.current_time()) and \
                    isinstance(head, h11.Response) and head.status_code == 503:
                tally.outcomes["hangup_during_kill"] += 1
                return
            if not isinstance(head, h11.Response) or head.status_code != 200:
                return tally.fail(f"hang-up stream got {head}")
            while seen < p["events"]:
                event = await conn.event()
                if not isinstance(event, h11.Data):
                    break  # it ended first
                seen += event.data.count(b"data: ")
        else:
            await trio.sleep(p["delay"])  # the client's own behaviour: it waits this long, then leaves
    finally:
        conn.close()
    if tally.kills is not None and tally.kills.cut(started, trio.current_time()):
        tally.outcomes["hangup_during_kill"] += 1  # it may have had a 500 or 503 it never read
    tally.outcomes["hung_up"] += 1


async def stall(port: int, tally: Tally, hold: float, n: int = 1, chat: bool = True) -> None:
    """Ask for big chunks, read until the first event, stop reading for `hold` seconds, then
    read what is left: the server must have cut the stream (no [DONE]) and closed the connection.

    The hold is this client's behaviour, not a wait for the server: it must outlast the time the
    server takes to fill the socket buffers (~15 tokens of ~1.5 KB here) plus its stall timeout.
    (The server's FIN is queued behind the unread data, so a client cannot see the cut without
    reading.) It starts at the first event, not at the send: with 32 clients on 8 rows a request
    may wait in the queue for seconds, and one that started decoding only after a hold counted
    from the send met a reader again and was served whole.

    With n > 1 (--hostile) every choice streams into the one connection: what they all left
    unread counts against the server's unread cap, and the cut ends every choice."""
    body: dict[str, Any] = {"max_tokens": 900, "ignore_eos": True, "stream": True, **({"n": n} if n > 1 else {})}
    if chat:
        body.update(messages=HELLO, logprobs=True, top_logprobs=20)
    else:
        body.update(prompt="Hello there", logprobs=5)
    conn = await Conn.open(port, rcvbuf=4096)
    raw = b""
    started = trio.current_time()
    kind = "stall" if n == 1 else "n_stall"
    try:
        await conn.send("POST", CHAT if chat else TEXT, dumps(body))
        with trio.fail_after(60):
            while b"\ndata: " not in raw and (chunk := await conn.sock.recv(1 << 12)):
                raw += chunk  # the headers, then the first event (after its chunk's size): tokens come
        await trio.sleep(hold)
        with trio.fail_after(30):
            while chunk := await conn.sock.recv(1 << 16):
                raw += chunk
    finally:
        conn.close()
    if tally.kills is not None and tally.kills.cut(started, trio.current_time()):
        tally.outcomes[f"{kind}_during_kill"] += 1  # the kill may have ended it first
        if raw.startswith(b"HTTP/1.1 503") or b"generation_failed" in raw:
            return  # it arrived while the actor restarted, or the kill ended it (error, then [DONE])
    if not raw.startswith(b"HTTP/1.1 200") or b"data: [DONE]" in raw:
        return tally.fail(f"a stalled reader's stream (n={n}) was not cut by the server: "
                          f"{raw[:60]!r}...{raw[-100:]!r}")
    tally.outcomes[f"{kind}_reaped"] += 1


async def invalid(port: int, p: dict[str, Any], tally: Tally) -> None:
    path, body, content_type = INVALID[p["case"]]
    r = await fetch_retrying(port, path, body, tally, content_type)
    try:
        assert 400 <= r.status < 500, r.status
        err = json.loads(r.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    except (AssertionError, KeyError, ValueError) as exc:
        return tally.fail(f"invalid body {body[:80]!r}: HTTP {r.status} {r.body[:200]!r} ({exc})")
    tally.outcomes["rejected"] += 1


async def huge(port: int, p: dict[str, Any], tally: Tally) -> None:
    """Megabytes of text: refused from its length, before tokenizing (server/_intake.py)."""
    text = "word " * (p["chars"] // 5)
    path, body = (CHAT, {"messages": [{"role": "user", "content": text}]}) if p["chat"] else (TEXT, {"prompt": text})
    r = await fetch_retrying(port, path, dumps({**body, "max_tokens": 4}), tally)
    if r.status != 400 or b"context_length_exceeded" not in r.body:
        return tally.fail(f"a prompt of {p['chars']} characters: HTTP {r.status} {r.body[:200]!r}")
    tally.outcomes["huge_rejected"] += 1


def _tool_fn(text: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}


def _anthropic_tool(text: str) -> dict[str, Any]:
    return {"name": "f", "description": text, "input_schema": {"type": "object"}}


# Megabytes of tool text, each API's way (tests/unit/test_hostile_bounds.py): (path, body of the
# text, the error's shape). The cheap bound counts tool definitions and calls' arguments too.
TOOL_TEXT: dict[str, tuple[str, Any, str]] = {
    "chat tools": (CHAT, lambda t: {"messages": HELLO, "tools": [_tool_fn(t)], "max_tokens": 2}, "openai"),
    "chat tool_calls": (CHAT, lambda t: {"max_tokens": 2, "messages": [
        *HELLO, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": t})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "openai"),
    "anthropic tools": (MESSAGES, lambda t: {"model": SERVED, "max_tokens": 2, "messages": HELLO,
                                             "tools": [_anthropic_tool(t)]}, "anthropic"),
    "anthropic tool_use": (MESSAGES, lambda t: {"model": SERVED, "max_tokens": 2, "messages": [
        *HELLO, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": t}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}, "anthropic"),
    "responses tools": (RESPONSES, lambda t: {"input": "Hello", "max_output_tokens": 16, "tools": [
        {"type": "function", "name": "f", "description": t, "parameters": {"type": "object"}}]}, "openai"),
    "responses function_call": (RESPONSES, lambda t: {"max_output_tokens": 16, "input": [
        {"role": "user", "content": "Hello"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps({"a": t})},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "openai"),
}


def refusal(r: Response, shape: str, **want: str) -> str | None:
    """None if `r` is a 400 in its API's error shape (`want`: fields the error must hold), else what is wrong."""
    try:
        assert r.status == 400, r.status
        body = json.loads(r.body)
        if shape == "anthropic":  # Anthropic's: the message says why
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["message"].startswith("prompt is too long"), body
        else:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            for key, value in want.items():
                assert value in str(err[key]), (key, value, err)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        return f"HTTP {r.status} {r.body[:300]!r} ({exc})"
    return None


async def grammar_bomb(port: int, p: dict[str, Any], tally: Tally) -> None:
    """A JSON schema under 1 KB whose check took 45 s and 2.3 GB (500 patterns: a panic that ended
    the server): checked in a worker process, killed at its 5 s bound; a 400 for this request only."""
    allof = [{"pattern": f".*{c}.*"} for c in p["letters"]]
    schema = {"type": "object", "properties": {"a": {"type": "string", "allOf": allof}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}
    path, body = (CHAT, {"messages": HELLO}) if p["chat"] else (TEXT, {"prompt": "Hello"})
    started = trio.current_time()
    r = await fetch_retrying(port, path, dumps({**body, "max_tokens": 4, "response_format": fmt}), tally)
    if wrong := refusal(r, "openai", param="response_format", message="cannot be enforced"):
        return tally.fail(f"a grammar bomb of {len(allof)} patterns: {wrong}")
    tally.refused("grammar_bomb", path, trio.current_time() - started)


async def tool_text(port: int, p: dict[str, Any], tally: Tally) -> None:
    """Megabytes in a tool's description or a call's arguments: 400 from its length, before rendering."""
    path, build, shape = TOOL_TEXT[p["case"]]
    data = dumps(build("x" * (p["mb"] * 1_000_000)))
    started = trio.current_time()
    r = await fetch_retrying(port, path, data, tally)
    if wrong := refusal(r, shape, code="context_length_exceeded"):
        return tally.fail(f"{p['mb']} MB of tool text ({p['case']}): {wrong}")
    tally.refused("tool_text", path, trio.current_time() - started)


async def count_tokens(port: int, p: dict[str, Any], tally: Tally) -> None:
    """Megabytes to count (in a message, or a tool): 400 from the length, as generation has."""
    text = "x" * (p["mb"] * 1_000_000)
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": text}]}
    if p["in_tool"]:
        body = {"model": SERVED, "messages": HELLO, "tools": [_anthropic_tool(text)]}
    started = trio.current_time()
    r = await fetch_retrying(port, COUNT_TOKENS, dumps(body), tally)
    if wrong := refusal(r, "anthropic"):
        return tally.fail(f"count_tokens of {p['mb']} MB: {wrong}")
    tally.refused("count_tokens", COUNT_TOKENS, trio.current_time() - started)


async def token_ids(port: int, p: dict[str, Any], tally: Tally) -> None:
    """A prompt of millions of token ids: refused from its count, before any id is validated."""
    ids = b"[" + b"5, " * (p["ids"] - 1) + b"5]"
    data = b'{"max_tokens": 2, "prompt": ' + (b"[" + ids + b"]" if p["nested"] else ids) + b"}"
    started = trio.current_time()
    r = await fetch_retrying(port, TEXT, data, tally)
    if wrong := refusal(r, "openai", code="context_length_exceeded", param="prompt",
                        message=f"{p['ids']} token ids"):
        return tally.fail(f"a prompt of {p['ids']} token ids: {wrong}")
    tally.refused("token_ids", TEXT, trio.current_time() - started)


async def framing(port: int, p: dict[str, Any], tally: Tally) -> None:
    """Content-Length and Transfer-Encoding both (a smuggling attempt), a request pipelined behind:
    one 400 `invalid_framing`, then the connection closed; the pipelined request is not served."""
    body = dumps({"prompt": "a", "max_tokens": 1})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    behind = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" if p["pipelined"] == "GET /health" else
              b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (TEXT.encode(), len(body), body))
    head = (f"POST {TEXT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(chunked)}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    conn = await Conn.open(port)
    started = trio.current_time()
    raw = b""
    try:
        await conn.sock.send(head + chunked + behind)
        with trio.fail_after(20):
            while chunk := await conn.sock.recv(1 << 16):  # the 400, then the server closes
                raw += chunk
    finally:
        conn.close()
    if not raw.startswith(b"HTTP/1.1 400") or b"invalid_framing" not in raw or raw.count(b"HTTP/1.1 ") != 1 \
            or b"connection: close" not in raw.lower():
        return tally.fail(f"Content-Length with Transfer-Encoding, {p['pipelined']} behind: {raw[:400]!r}")
    tally.refused("framing", "", trio.current_time() - started)


async def slow_body(port: int, p: dict[str, Any], tally: Tally, body_timeout: float) -> None:
    """A body sent in pieces, 0.2 s apart: answered whole. Or never finished: 408 after the body timeout."""
    body = dumps({"prompt": p["prompt"], "max_tokens": p["max_tokens"], "ignore_eos": True})
    conn = await Conn.open(port)
    started = trio.current_time()
    try:
        head = (f"POST {TEXT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        await conn.sock.send(head)
        cut = [len(body) * i // p["pieces"] for i in range(p["pieces"] + 1)]
        pieces = [body[a:b] for a, b in zip(cut, cut[1:], strict=False)]
        if not p["finish"]:
            pieces = pieces[:-1]
        for piece in pieces:
            await trio.sleep(0.2)
            await conn.sock.send(piece)
        raw = b""
        with trio.fail_after(body_timeout + 20):
            while chunk := await conn.sock.recv(1 << 16):
                raw += chunk
    finally:
        conn.close()
    status = raw[9:12]
    if p["finish"]:
        if status == b"503" and tally.kills is not None and tally.kills.cut(started, trio.current_time()):
            tally.outcomes["restarting_503"] += 1  # not retried: one request of this kind is enough
            return
        if tally.kills is not None and tally.kills.cut(started, trio.current_time()) and b"generation_failed" in raw:
            tally.outcomes["cut_by_kill_500"] += 1
            return
        if status != b"200" or f'"completion_tokens":{p["max_tokens"]}'.encode() not in raw.replace(b" ", b""):
            return tally.fail(f"a slow body sent whole: {raw[:300]!r}")
        tally.outcomes["slow_body_served"] += 1
    else:
        if status != b"408":
            return tally.fail(f"a body never finished: {raw[:300]!r}")
        tally.outcomes["slow_body_timed_out"] += 1


ATTACKS = {"grammar_bomb": grammar_bomb, "tool_text": tool_text, "count_tokens": count_tokens,
           "token_ids": token_ids, "framing": framing}


async def kill_actor(port: int, tally: Tally, when: Any, within: float) -> None:
    """When `when()` says so, SIGKILL the actor process, then wait for /ready 200 again."""
    assert tally.kills is not None
    while not when():  # noqa: ASYNC110 - a condition on the clients' progress, polled
        await trio.sleep(0.05)
    pid = json.loads((await fetch(port, "GET", "/health")).body)["actor_pid"]
    os.kill(pid, signal.SIGKILL)
    tally.kills.at.append(trio.current_time())
    with trio.move_on_after(within):
        while True:  # ready again with a new actor (the server needs a moment to see the death)
            r = await fetch(port, "GET", "/health")
            if r.status == 200 and json.loads(r.body).get("actor_pid") not in (None, pid) and \
                    (await fetch(port, "GET", "/ready")).status == 200:
                break
            await trio.sleep(0.05)
        tally.kills.back.append(trio.current_time())
        return
    tally.fail(f"the server was not ready again {within} s after the actor was killed")


async def run_mix(port: int, opts: Options, items: list[tuple[str, dict[str, Any]]], tally: Tally) -> None:
    todo = iter(items)

    async def worker() -> None:
        for kind, p in todo:
            tally.planned[kind if kind != "hangup" else f"hangup_{p['moment']}"] += 1
            try:
                with trio.fail_after(60):
                    if kind == "ok":
                        await well_behaved(port, p, tally)
                    elif kind == "hangup":
                        await hang_up(port, p, tally)
                    elif kind == "stall":
                        await stall(port, tally, opts.stall_hold or max(3.0, 6 * opts.stall_timeout))
                    elif kind == "huge":
                        await huge(port, p, tally)
                    elif kind == "slow_body":
                        await slow_body(port, p, tally, opts.body_timeout)
                    elif kind == "n_stall":
                        await stall(port, tally, opts.stall_hold or max(3.0, 6 * opts.stall_timeout), 4, p["chat"])
                    elif kind in ATTACKS:
                        await ATTACKS[kind](port, p, tally)
                    else:
                        await invalid(port, p, tally)
            except (OSError, trio.TooSlowError, h11.ProtocolError, AssertionError) as exc:
                tally.fail(f"{kind} {p}: {type(exc).__name__}: {exc}"[:500])

    async with trio.open_nursery() as nursery:
        for _ in range(opts.concurrency):
            nursery.start_soon(worker)


@dataclass
class Health:
    """A well-behaved monitor: `GET /health` every `interval` seconds while the clients run (`on`),
    each on a fresh connection; what it waited and what it got."""

    interval: float
    on: bool = False
    seconds: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    async def poll(self, port: int) -> None:
        while True:
            if self.on:
                started = trio.current_time()
                try:
                    with trio.fail_after(30):
                        r = await fetch(port, "GET", "/health")
                    self.statuses[r.status] += 1
                    if r.status != 200 and len(self.errors) < 5:  # "stalled" while it works would be false
                        self.errors.append(f"HTTP {r.status} {r.body[:200]!r}")
                except (OSError, trio.TooSlowError, h11.ProtocolError, AssertionError) as exc:
                    self.statuses[0] += 1
                    if len(self.errors) < 5:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                self.seconds.append(trio.current_time() - started)
            await trio.sleep(self.interval)

    def report(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else 0.0
        return {"polls": len(ordered), "statuses": dict(self.statuses), "p50_seconds": at(0.5),
                "p99_seconds": at(0.99), "max_seconds": at(1.0)}


# ---- the server -------------------------------------------------------------------------------


class ServerProcess:
    def __init__(self, proc: trio.Process):
        self.proc = proc
        self.log = b""
        self.port: int | None = None
        self.up = trio.Event()
        self.thread_actor = True  # MLX's buffer cache is in this process (else the actor's)
        self.caches: list[int] = []  # MLX's buffer cache at each steady_rss()
        self.active: list[int] = []  # MLX's memory in use at each steady_rss()

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        async for chunk in self.proc.stderr:
            self.log += chunk
            if self.port is None and (m := re.search(rb"Running on http://127\.0\.0\.1:(\d+)", self.log)):
                self.port = int(m.group(1))
                self.up.set()

    def rss(self) -> int:
        """The server process's resident memory, from /proc on Linux, psutil elsewhere."""
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            import psutil  # not Linux: psutil, if present

            return int(psutil.Process(self.proc.pid).memory_info().rss)

    async def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        from prometheus_client.parser import text_string_to_metric_families

        assert self.port is not None
        r = await fetch(self.port, "GET", "/metrics")
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(r.body.decode()):
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    async def idle(self, within: float = 30.0) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Poll /metrics until nothing is queued, active or streaming; return that scrape."""
        names = ("trio_mlx_queue_depth", "trio_mlx_active_sequences", "trio_mlx_open_streams")
        m: dict[str, list[tuple[dict[str, str], float]]] = {}
        with trio.move_on_after(within):
            while True:
                m = await self.metrics()
                if all(value(m, name) == 0 for name in names) and \
                        sum(v for _, v in m["trio_mlx_requests_in_engine"]) == 0:
                    return m
                await trio.sleep(0.05)
        left = {name: value(m, name) for name in names} | {
            "in_engine": m.get("trio_mlx_requests_in_engine"), "state": m.get("trio_mlx_engine_state")}
        raise AssertionError(f"the server was not idle {within} s after the clients finished: {left}")

    async def steady_rss(self) -> int:
        """Resident memory once idle, less MLX's buffer cache (freed buffers it keeps for reuse,
        6-13 MB after a soak step with the tiny model, depending on the shapes last used: noise
        as large as the leaks looked for); the median of five reads over half a second. Against
        a process actor, read again while it still comes down by over 1 MB (a late trim)."""
        m = await self.idle()
        if not self.thread_actor:  # --hostile: large bodies' memory goes back a second after the last
            await trio.sleep(1.5)
        cache = int(value(m, "trio_mlx_mlx_cache_memory_bytes"))
        kept = int(value(m, "trio_mlx_prompt_cache_bytes"))  # the prompt cache's entries: held on purpose
        held = cache + kept if self.thread_actor else 0  # a process actor's are in its child
        rss = await self._median_rss(held)
        if not self.thread_actor:
            # the trim may come late on a loaded machine (a worker thread, a second after the
            # last large body): while the memory is still coming down, wait for it, 6 s at most
            with trio.move_on_after(6):
                while (later := await self._median_rss(held)) < rss - 1_000_000:
                    rss = later
        self.caches.append(cache)
        self.active.append(int(value(m, "trio_mlx_mlx_active_memory_bytes")) - kept)
        return rss

    async def _median_rss(self, held: int) -> int:
        """The median of five reads over half a second, less `held`."""
        reads = []
        for _ in range(5):
            reads.append(self.rss() - held)
            await trio.sleep(0.1)
        return sorted(reads)[2]


def value(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for have, v in m.get(name, []) if all(have.get(k) == x for k, x in labels.items()))


def server_command(model: str, opts: Options) -> list[str]:
    return [sys.executable, "-m", "trio_mlx.cli", "serve", model, "--port", "0",
            "--stall-timeout", str(opts.stall_timeout), "--max-batch", str(opts.max_batch),
            "--prefill-batch", "2", "--prefill-step", "16", "--ping-interval", "1", "--drain-timeout", "5",
            "--cache-limit-gb", "0",  # MLX's memory in use exactly the live arrays' bytes (the docstring)
            "--access-log" if opts.access_log else "--no-access-log", "--log-level", "info",
            *(["--actor", "process", "--body-timeout", str(opts.body_timeout), "--restart-limit",
               str(opts.kill_actor + 1), "--restart-backoff", "0.5",
               "--max-unread-tokens", str(opts.max_unread_tokens), "--model-name", SERVED] if opts.hostile else [])]


# ---- the soak ---------------------------------------------------------------------------------


async def run(opts: Options) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    warm_n = opts.warmup or max(100, opts.requests // 10)
    warm_items, soak_items = plan(opts, warm_n, rng), plan(opts, opts.requests, rng)
    with tempfile.TemporaryDirectory(prefix="trio-mlx-soak-") as tmp:
        model = opts.model
        if model is None:
            from trio_mlx.models import _test_models

            # with --hostile, one whose template renders tools: tool text meets the bound, not "no tools here"
            model = str(_test_models.build_test_model(Path(tmp) / "tiny", dtype="float32", tools=opts.hostile))
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        report: dict[str, Any] = {"options": asdict(opts), "warmup_requests": warm_n}
        health = Health(opts.health_interval)
        t_start = trio.current_time()
        with trio.fail_after(opts.deadline):
            async with trio.open_nursery() as nursery:
                proc = await trio.lowlevel.open_process(server_command(model, opts), env=env, cwd=ROOT,
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                server = ServerProcess(proc)
                nursery.start_soon(server.pump)
                try:
                    with trio.fail_after(60):
                        await server.up.wait()
                    assert server.port is not None
                    warm, soak = Tally(), Tally()
                    server.thread_actor = not opts.hostile
                    if opts.hostile:
                        soak.kills = Kills()
                    if opts.health_interval > 0:
                        nursery.start_soon(health.poll, server.port)
                    health.on = True
                    await run_mix(server.port, opts, warm_items, warm)
                    health.on = False
                    rss_warm = await server.steady_rss()
                    t_soak = trio.current_time()
                    rss_timeline, idle_seconds = [rss_warm], 0.0
                    part = math.ceil(len(soak_items) / max(1, opts.rss_samples))
                    parts = range(0, len(soak_items), part)
                    for k, i in enumerate(parts):  # RSS after each part: a leak climbs
                        kills = opts.kill_actor if opts.hostile else 0
                        share = kills // len(parts) + (1 if k < kills % len(parts) else 0)
                        async with trio.open_nursery() as mix:
                            for j in range(share):  # at evenly spread moments of this part
                                mark = sum(soak.planned.values()) + (j + 1) * min(part, len(soak_items) - i) \
                                    // (share + 1)
                                mix.start_soon(kill_actor, server.port, soak,
                                               lambda mark=mark: sum(soak.planned.values()) >= mark,
                                               opts.restart_within)
                            health.on = True
                            await run_mix(server.port, opts, soak_items[i:i + part], soak)
                            health.on = False
                        t_idle = trio.current_time()
                        rss_timeline.append(await server.steady_rss())
                        idle_seconds += trio.current_time() - t_idle
                    soak_seconds = trio.current_time() - t_soak - idle_seconds
                    m = await server.idle()
                    rss_after = rss_timeline[-1]
                finally:
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(30):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                    nursery.cancel_scope.cancel()
        if opts.server_log:
            await trio.Path(opts.server_log).write_bytes(server.log)
        log = server.log.decode("utf-8", "replace")
        report.update(judge(opts, warm, soak, m, rss_warm, rss_after, server.active, log, proc.returncode, health))
        report["rss_timeline_bytes"] = rss_timeline  # less MLX's buffer cache (below)
        report["mlx_cache_timeline_bytes"] = server.caches
        report["mlx_active_timeline_bytes"] = server.active  # idle: weights and whatever was left behind
        report["soak_seconds"] = round(soak_seconds, 1)
        report["wall_seconds"] = round(trio.current_time() - t_start, 1)
        report["completion_tokens_per_second"] = round(soak.completion_tokens / soak_seconds, 1)
        return report


def judge(opts: Options, warm: Tally, soak: Tally, m: Any, rss_warm: int, rss_after: int, active: list[int],
          log: str, rc: int | None, health: Health) -> dict[str, Any]:
    failures = [f"warm-up: {f}" for f in warm.failures] + soak.failures
    both = Tally(planned=warm.planned + soak.planned, outcomes=warm.outcomes + soak.outcomes)
    statuses = Counter[str]()
    for labels, v in m.get("trio_mlx_requests_total", []):
        if labels["endpoint"] in (CHAT, TEXT) and v:
            statuses[labels["status"]] += int(v)
    # 5xx only from the kills: 500 for requests in flight, 503 while the new actor loaded; a client that
    # hung up or stalled across a kill may have had one it never read.
    unread = both.outcomes["hangup_during_kill"] + both.outcomes["stall_during_kill"] \
        + both.outcomes["n_stall_during_kill"]
    if not both.outcomes["cut_by_kill_500"] <= statuses["500"] <= both.outcomes["cut_by_kill_500"] + unread \
            or not both.outcomes["restarting_503"] <= statuses["503"] <= both.outcomes["restarting_503"] + unread \
            or any(s.startswith("5") and s not in ("500", "503") for s in statuses):
        failures.append(f"5xx answers: {dict(statuses)}; requests cut by a kill {both.outcomes['cut_by_kill_500']}, "
                        f"503s while restarting {both.outcomes['restarting_503']}, unread {unread}")
    fourxx = sum(v for s, v in statuses.items() if s.startswith("4"))
    attacks_4xx = warm.counted_4xx + soak.counted_4xx  # grammar bombs, tool text, token ids on these paths
    expected_4xx = both.planned["invalid"] + both.outcomes["huge_rejected"] + both.outcomes["slow_body_timed_out"] \
        + attacks_4xx
    if fourxx != expected_4xx:
        failures.append(f"{fourxx} 4xx answers for {both.planned['invalid']} invalid bodies, "
                        f"{both.outcomes['huge_rejected']} huge prompts, {both.outcomes['slow_body_timed_out']} "
                        f"unfinished bodies, {attacks_4xx} other attacks refused on these paths")
    for kind in ATTACKS:
        if both.planned[kind] != both.outcomes[f"{kind}_rejected"]:
            failures.append(f"{both.planned[kind]} {kind} attacks, {both.outcomes[f'{kind}_rejected']} refused")
    # one stall abort per reaped reader, four for an n=4 one (every choice); fewer if a kill ended it first
    stalls = value(m, "trio_mlx_aborts_by_cause_total", cause="stall")
    reaped = both.outcomes["stall_reaped"] + 4 * both.outcomes["n_stall_reaped"]
    if not reaped - both.outcomes["stall_during_kill"] - 4 * both.outcomes["n_stall_during_kill"] <= stalls <= reaped:
        failures.append(f"{stalls} stall aborts for {both.outcomes['stall_reaped']} reaped readers and "
                        f"{both.outcomes['n_stall_reaped']} reaped n=4 readers")
    health_report = health.report()
    if health.interval > 0 and (not health.seconds or health_report["p99_seconds"] >= opts.health_p99):
        failures.append(f"/health's p99 latency {health_report['p99_seconds']} s (>= {opts.health_p99} s): "
                        f"{health_report}")
    if health.errors:
        failures.append(f"/health answered other than 200: {health.errors}")
    for t in (warm, soak):
        for key, texts in t.greedy.items():
            if len(texts) != 1:
                failures.append(f"greedy {key!r} gave {len(texts)} different answers")
    if len(warm.chat_prompt_tokens | soak.chat_prompt_tokens) > 1:
        failures.append(f"one chat prompt, several prompt_tokens: {warm.chat_prompt_tokens | soak.chat_prompt_tokens}")
    expected = EXPECTED_KILL_LINE if soak.kills is not None else None
    bad_lines = [line for line in log.splitlines()
                 if not (expected is not None and expected.search(line)) and (
                     re.search(r"\b(ERROR|CRITICAL|Traceback)\b", line)
                     or (" WARNING " in line and not EXPECTED_WARNING.search(line)))]
    if bad_lines:
        failures.append("unexpected log lines: " + " | ".join(bad_lines[:5]))
    if rc != 0:
        failures.append(f"the server exited {rc} after SIGTERM")
    mlx_growth = active[-1] - active[0]
    if mlx_growth > opts.mlx_tolerance:
        failures.append(f"MLX memory in use, idle, grew {mlx_growth} bytes (> {opts.mlx_tolerance}): {active}")
    growth = (rss_after - rss_warm) / rss_warm
    if growth > opts.rss_tolerance:
        failures.append(f"RSS grew {growth:.1%} (> {opts.rss_tolerance:.0%}): {rss_warm} -> {rss_after} bytes")
    stage = {s: int(value(m, "trio_mlx_aborts_by_stage_total", stage=s)) for s in ("queued", "prefill", "decode")}
    cause = {labels["cause"]: int(v) for labels, v in m.get("trio_mlx_aborts_by_cause_total", []) if v}
    lost = both.planned["ok"] - both.outcomes["completed"] - both.outcomes["ok_cut_by_kill"]
    hostile: dict[str, Any] = {}
    if soak.kills is not None:
        restart = [round(b - a, 2) for a, b in zip(soak.kills.at, soak.kills.back, strict=False)]
        if len(restart) != opts.kill_actor:
            failures.append(f"{opts.kill_actor} kills planned, {len(soak.kills.at)} made, {len(restart)} recovered")
        if lost:
            failures.append(f"{lost} well-behaved requests neither completed nor were cut by a kill")
        seconds = {k: warm.attack_seconds.get(k, []) + soak.attack_seconds.get(k, []) for k in ATTACKS}
        hostile = {"actor_kills": len(soak.kills.at), "serving_again_after_seconds": restart,
                   "lost_requests": lost, "actor_restarts": int(value(m, "trio_mlx_actor_restarts_total")),
                   "attack_refused_within_seconds": {k: round(max(v), 2) for k, v in seconds.items() if v},
                   "stall_cuts": {"stall_timeout": len(re.findall(r"the client took no data for", log)),
                                  "unread_cap": len(re.findall(r"tokens behind; aborting it", log))}}
    return {
        "failures": failures,
        **hostile,
        "health": health_report,
        "planned": dict(both.planned),
        "client_outcomes": dict(both.outcomes),
        "http_statuses": dict(statuses),
        "aborts_by_stage": stage,
        "aborts_by_cause": cause,
        "engine_requests_submitted": int(value(m, "trio_mlx_engine_requests_submitted_total")),
        "engine_generated_tokens": int(value(m, "trio_mlx_engine_generated_tokens_total")),
        "completed_tokens_checked": warm.completion_tokens + soak.completion_tokens,
        "greedy_prompts_checked": {k: len(v) for k, v in soak.greedy.items()},
        "rss_after_warmup_bytes": rss_warm,
        "rss_after_soak_bytes": rss_after,
        "rss_growth": round(growth, 4),
        "rss_is": "the server's resident memory less MLX's buffer cache, idle",
        "mlx_peak_memory_bytes": int(value(m, "trio_mlx_mlx_peak_memory_bytes")),
        "log_warnings_expected": sum(1 for line in log.splitlines() if EXPECTED_WARNING.search(line)),
        "server_exit_code": rc,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Options()
    for name, default in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = float if isinstance(default, float) else int if isinstance(default, int) else str
            parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--json", help="also write the report to this file")
    args = vars(parser.parse_args(argv))
    out = args.pop("json")
    report = trio.run(run, Options(**args))
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout: this repository's trio_mlx
    sys.exit(main())
