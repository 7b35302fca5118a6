"""`trio-mlx bench`: statistics, SSE and HTTP parsing, prompts, the --limit ceiling, plots and
tables, and the HTTP mode against real servers on 127.0.0.1 (a fake SSE server in-process, and
mlx_lm.server in a subprocess).

Here what needs no model run: statistics, parsing, prompts (the tiny model's tokenizer), plots,
tables and the HTTP mode against a fake SSE server; the modes that run a model:
tests/integration/test_bench.py; against mlx_lm.server in a subprocess: tests/system/test_bench.py.
"""

from __future__ import annotations

import json
import math
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_mlx.bench import _cli as _bench
from trio_mlx.bench import _http as _bench_http
from trio_mlx.bench import _sweep
from trio_mlx.bench._http import SSEReader
from trio_mlx.bench._prompts import load_tokenizer, make_prompts
from trio_mlx.bench._stats import (
    RequestRecord,
    check_length,
    format_table,
    level_stats,
    percentile,
    plot_lines,
    summarize,
    write_plot,
)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_fp32: Path) -> Path:
    return tiny_model_fp32


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(str(tiny_model))


# ---------------------------------------------------------------- statistics


def test_percentile_matches_known_values_and_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    np = pytest.importorskip("numpy")
    xs = sorted(random.Random(1).expovariate(1.0) for _ in range(101))
    for q in (1, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summarize_reports_ms_and_handles_empty() -> None:
    s = summarize([0.003, 0.001, 0.002])
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(2.0)
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(3.0)
    assert s["p50"] == pytest.approx(2.0)
    assert s["p90"] == pytest.approx(2.8)
    empty = summarize([])
    assert empty["n"] == 0 and empty["p50"] is None and empty["mean"] is None


def test_level_stats_counts_every_error_and_derives_rates() -> None:
    ok = RequestRecord(ttft=0.1, e2e=1.0, output_tokens=10, events=10, itl=[0.1] * 9)
    short = RequestRecord(ttft=0.1, e2e=0.5, output_tokens=4, events=4, finish_reason="stop")
    check_length(short, 10)
    excess = RequestRecord(ttft=0.1, e2e=0.5, output_tokens=11, events=11)
    check_length(excess, 10)
    reset = RequestRecord(error="reset", message="Connection reset by peer")
    timeout = RequestRecord(error="timeout", message="slow")
    stats = level_stats([ok, short, excess, reset, timeout], duration=2.0, concurrency=5, rate=None)
    assert stats["requests"] == 5 and stats["completed"] == 1
    assert stats["errors"]["total"] == 4
    assert stats["errors"]["by_reason"] == {
        "short_output": 1,
        "excess_output": 1,
        "reset": 1,
        "timeout": 1,
    }
    assert "4 tokens of 10" in stats["errors"]["samples"]["short_output"]
    assert stats["output_tokens"] == 25  # tokens received count, even from failed requests
    assert stats["output_throughput"] == pytest.approx(12.5)
    assert stats["request_throughput"] == pytest.approx(0.5)  # only successes
    assert stats["ttft_ms"]["n"] == 1 and stats["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert stats["tpot_ms"]["p50"] == pytest.approx(100.0)  # (1.0 - 0.1) / 9
    assert stats["itl_ms"]["n"] == 9
    assert stats["e2e_ms"]["max"] == pytest.approx(1000.0)


def test_levels_and_counts() -> None:
    args = _bench._parser().parse_args(
        ["--url", "http://x", "--model", "m", "--concurrency", "1,8,32"]
    )
    assert _bench.levels_and_counts(args) == [(1, None, 8), (8, None, 16), (32, None, 64)]
    args = _bench._parser().parse_args(
        ["--url", "http://x", "--model", "m", "--rate", "2,inf", "--requests-per-level", "5"]
    )
    assert _bench.levels_and_counts(args) == [(None, 2.0, 5), (None, math.inf, 5)]
    with pytest.raises(SystemExit):
        _bench._parser().parse_args(["--url", "http://x", "--model", "m", "--concurrency", "0"])



def test_the_engine_mode_tunes_its_actor_as_a_server_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine` runs the actor in the bench's process: the TRIO_MLX_* variables that tune a
    server's actor tune it (through the public `ActorTuning`), under the bench's own flags."""
    import trio_mlx

    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "3")
    monkeypatch.setenv("TRIO_MLX_ADMIT_WINDOW", "0.5")
    argv = ["--engine", "--model", "m"]
    tuning = _bench.bench_tuning(_bench._parser().parse_args(argv), max_batch=4)
    assert tuning == trio_mlx.ActorTuning(max_batch=4, retire_steps=3, admit_window=0.5)
    tuning = _bench.bench_tuning(_bench._parser().parse_args([*argv, "--admit-window", "0"]), max_batch=4)
    assert tuning.admit_window == 0.0 and tuning.retire_steps == 3


# ------------------------------------------------------------ SSE and HTTP/1.1


def _sse(events: list[Any], *, done: bool = True) -> bytes:
    out = b": keepalive 3/8\n\n"
    for ev in events:
        out += b"data: " + json.dumps(ev).encode() + b"\r\n\r\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


COMPLETION = _sse(
    [{"choices": [{"text": t, "finish_reason": None}]} for t in ("a", "", "b", "c")]
    + [
        {"choices": [{"text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}},
    ]
)


def _feed_split(data: bytes, cuts: list[int], max_tokens: int) -> RequestRecord:
    reader = SSEReader(RequestRecord())
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    for i, piece in enumerate(pieces):
        reader.feed(piece, float(i))
    return reader.finish(max_tokens)


def test_sse_reader_same_result_for_any_split() -> None:
    whole = _feed_split(COMPLETION, [], 4)
    assert whole.error is None and whole.output_tokens == 4 and whole.events == 3
    assert whole.finish_reason == "length"
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(COMPLETION)), rng.randint(1, 12)))
        rec = _feed_split(COMPLETION, cuts, 4)
        assert (rec.error, rec.output_tokens, rec.events, rec.finish_reason) == (
            None,
            4,
            3,
            "length",
        )
        assert rec.ttft is not None and len(rec.itl) == 2
        assert rec.ttft <= rec.ttft + sum(rec.itl) <= len(cuts)  # times are read times


def test_sse_reader_chat_deltas_usage_and_failures() -> None:
    chat = _sse(
        [{"choices": [{"delta": {"role": "assistant"}}]}]  # no content: not the first token
        + [{"choices": [{"delta": {"content": "x"}}]}] * 3
        + [{"choices": [], "usage": {"completion_tokens": 3}}]
    )
    reader = SSEReader(RequestRecord())
    reader.feed(chat[:30], 1.0)
    reader.feed(chat[30:], 2.0)
    rec = reader.finish(3)
    assert rec.error is None and rec.events == 3 and rec.ttft == 2.0

    no_usage = SSEReader(RequestRecord())  # without usage, content events are the count
    no_usage.feed(_sse([{"choices": [{"text": "x"}]}] * 2), 0.0)
    assert no_usage.finish(2).output_tokens == 2

    cut = SSEReader(RequestRecord())
    cut.feed(_sse([{"choices": [{"text": "x"}]}], done=False), 0.0)
    assert cut.finish(1).error == "incomplete"

    err = SSEReader(RequestRecord())
    err.feed(_sse([{"error": {"message": "engine died"}}]), 0.0)
    rec = err.finish(1)
    assert rec.error == "stream_error" and "engine died" in (rec.message or "")

    with pytest.raises(ValueError):
        SSEReader(RequestRecord()).feed(b"data: {not json\n", 0.0)


async def test_chunked_decoding_across_reads_and_trailers() -> None:
    body = [b"data: one\n\n", b"data: two\n\n", b"x" * 300]
    wire = b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in body)
    wire += b"0\r\nTrailer: yes\r\n\r\nNEXT"

    async def decode(pieces: list[bytes]) -> tuple[bytes, bytes]:
        later = iter(pieces[1:])
        got: list[bytes] = []

        async def recv(_n: int) -> bytes:
            await trio.lowlevel.checkpoint()
            return next(later, b"")

        rest = await _bench_http._read_chunked(recv, pieces[0], lambda d, _t: got.append(d), 0.0)
        return b"".join(got), rest

    for step in (1, 2, 7, 64, len(wire)):
        got, rest = await decode([wire[i : i + step] for i in range(0, len(wire), step)])
        assert got == b"".join(body)
        assert b"NEXT".startswith(rest)  # what follows the body stays for the next response

    async def cut_short(_n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        return b""

    with pytest.raises(_bench_http.ProtocolViolation):
        await _bench_http._read_chunked(cut_short, b"a\r\nshort", lambda d, _t: None, 0.0)


# ------------------------------------------------------------------- prompts


def test_prompts_have_exact_length_and_distinct_heads(tokenizer: Any) -> None:
    prompts = make_prompts(tokenizer, 40, 32, seed=3)
    assert len(prompts) == 40
    for p in prompts:
        assert len(p.ids) == 32
        assert list(tokenizer.encode(p.text)) == list(p.ids)  # what a server will see
    heads = {p.ids[:3] for p in prompts}
    assert len(heads) == 40  # no two prompts share a prefix a cache could reuse
    # Deterministic, and more prompts only add at the end: warm-up prompts are
    # drawn after the measured ones, so every target gets the same measured set.
    again = make_prompts(tokenizer, 45, 32, seed=3)
    assert [p.ids for p in again[:40]] == [p.ids for p in prompts]
    assert make_prompts(tokenizer, 1, 32, seed=4)[0].ids != prompts[0].ids


def test_chat_prompts_count_the_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "has_chat_template", False):
        pytest.skip("the tiny model's tokenizer has no chat template")
    for p in make_prompts(tokenizer, 5, 48, seed=0, chat=True):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True
        )
        assert len(ids) == 48 and list(ids) == list(p.ids)


# -------------------------------------------------------------- --limit mode


class FakeBatchGenerator:
    """BatchGenerator's insert/next contract, one token per live sequence per step."""

    def __init__(self, prefill_steps: int = 2) -> None:
        self.prefill_steps = prefill_steps
        self.live: dict[int, list[int]] = {}  # uid -> [steps seen, tokens made, max_tokens]
        self.next_uid = 0
        self.peak = 0

    def insert(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        uids = list(range(self.next_uid, self.next_uid + len(prompts)))
        self.next_uid += len(prompts)
        for uid, m in zip(uids, max_tokens, strict=True):
            self.live[uid] = [0, 0, m]
        self.peak = max(self.peak, len(self.live))
        return uids

    def next(self) -> tuple[list[Any], list[Any]]:
        out = []
        for uid, st in list(self.live.items()):
            st[0] += 1
            if st[0] <= self.prefill_steps:
                continue
            st[1] += 1
            done = st[1] >= st[2]
            out.append(type("R", (), {"uid": uid, "finish_reason": "length" if done else None}))
            if done:
                del self.live[uid]
        return [], out


def test_drive_keeps_the_closed_loop_full_and_times_every_token() -> None:
    from trio_mlx.bench._limit import drive

    bg = FakeBatchGenerator()
    records, duration = drive(bg, [[1, 2]] * 10, concurrency=3, max_tokens=5)
    assert bg.peak == 3  # never more in flight than the level's concurrency...
    assert bg.next_uid == 10  # ...and every prompt went through
    assert duration > 0
    for r in records:
        assert r.error is None and r.output_tokens == 5 and len(r.itl) == 4
        assert r.ttft is not None and r.e2e is not None and 0 < r.ttft <= r.e2e


# ---------------------------------------------------------------- plot, table


def _fake_result(label: str, target: str, tps: list[float]) -> dict[str, Any]:
    levels = []
    for c, tp in zip((1, 8), tps, strict=True):
        rec = RequestRecord(ttft=0.01 * c, e2e=1.0, output_tokens=10, events=10, itl=[0.1] * 9)
        levels.append(level_stats([rec], duration=10 / tp, concurrency=c, rate=None))
    return {
        "label": label,
        "target": target,
        "model": "m",
        "prompt_tokens": 1,
        "max_tokens": 10,
        "levels": levels,
    }


def test_table_ratios_and_plot_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ceiling = _fake_result("ceiling", "limit", [100.0, 400.0])
    server = _fake_result("trio_mlx", "http://h", [90.0, 300.0])
    table = format_table([ceiling, server])
    rows = [r for r in table.splitlines() if r.startswith("| trio_mlx")]
    assert len(rows) == 2
    assert "| 0.90 |" in rows[0] and "| 0.75 |" in rows[1]
    assert "| ceiling | c=1 | 100 | 1.00 |" in table
    # a second ceiling run: each level's bar is the faster of the two
    after = _fake_result("ceiling after", "limit", [120.0, 200.0])
    rows = format_table([ceiling, server, after]).splitlines()
    assert [r.split(" | ")[3] for r in rows if r.startswith("| trio_mlx")] == ["0.75", "0.75"]
    assert [r.split(" | ")[3] for r in rows if r.startswith("| ceiling")] == ["0.83", "1.00", "1.00", "0.50"]
    # a Poisson level of 8 requests/s is not the closed loop's c=8: no ratio
    rec = RequestRecord(ttft=0.01, e2e=1.0, output_tokens=10, events=10, itl=[0.1] * 9)
    poisson = {"label": "p", "levels": [level_stats([rec], duration=1.0, concurrency=None, rate=8.0)]}
    assert "| p | 8.0/s | 10 | - |" in format_table([ceiling, poisson])

    paths = []
    for name, res in (("a", ceiling), ("b", server)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(res))
    png = tmp_path / "x.png"
    assert _bench.main(["plot", *map(str, paths), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == str(png)
    md = tmp_path / "t.md"
    assert _bench.main(["table", *map(str, paths), "-o", str(md)]) == 0
    assert md.read_text() == capsys.readouterr().out == table


def test_table_shows_the_bare_ceiling_and_the_fraction_of_the_physical_limit() -> None:
    ceiling = _fake_result("ceiling", "limit", [100.0, 400.0])
    bare = _fake_result("ceiling", "limit", [200.0, 800.0])
    for lv in bare["levels"]:
        lv["ceiling"] = "bare"
    ceiling["levels"] += bare["levels"]
    # TPOT p50 100 ms; 1e6 bytes of weights, 1e3 of KV a token, context 1 + 10 / 2 = 6
    ceiling["physical"] = {"weight_bytes": 1_000_000, "kv_bytes_per_token": 1000}
    server = _fake_result("trio_mlx", "http://h", [90.0, 300.0])
    table = format_table([ceiling, server])
    head = table.splitlines()[0]
    assert "| x ceiling | x bare | req/s |" in head and "x mem limit" not in head  # no bandwidth known
    # the bare rows stand beside the BatchGenerator's, each with its ratio to both bars
    assert [r.split(" | ")[:5] for r in table.splitlines()[2:6]] == [
        ["| ceiling", "c=1", "100", "1.00", "0.50"], ["| ceiling (bare)", "c=1", "200", "2.00", "1.00"],
        ["| ceiling", "c=8", "400", "1.00", "0.50"], ["| ceiling (bare)", "c=8", "800", "2.00", "1.00"]]
    assert "| trio_mlx | c=8 | 300 | 0.75 | 0.38 |" in table
    # a bandwidth given: the fraction, for the server too (the ceiling's bytes, the same model)
    table = format_table([ceiling, server], bandwidth_gbs=0.1)
    assert "| x ceiling | x bare | x mem limit | req/s |" in table.splitlines()[0]
    # c=1: (1e6 + 1e3 x 6) bytes / 0.1 GB/s = 10.06 ms of a TPOT of (1 - 0.01) / 9 s = 110 ms;
    # c=8: 10.48 ms of (1 - 0.08) / 9 s = 102.2 ms
    assert "| trio_mlx | c=1 | 90 | 0.90 | 0.45 | 0.09 |" in table
    assert "| trio_mlx | c=8 | 300 | 0.75 | 0.38 | 0.10 |" in table
    # or recorded by the run; a Poisson level has no fraction
    ceiling["physical"]["bandwidth_gbs"] = 0.01
    rec = RequestRecord(ttft=0.01, e2e=1.0, output_tokens=10, events=10, itl=[0.1] * 9)
    poisson = {"label": "p", "model": "m", "prompt_tokens": 1, "max_tokens": 10,
               "levels": [level_stats([rec], duration=1.0, concurrency=None, rate=8.0)]}  # fmt: skip
    table = format_table([ceiling, server, poisson])
    assert "| trio_mlx | c=1 | 90 | 0.90 | 0.45 | 0.91 |" in table
    assert "| p | 8.0/s | 10 | - | - | - |" in table
    assert set(plot_lines([ceiling])) == {"ceiling", "ceiling (bare)"}


def test_plot_skips_a_run_that_died_before_its_first_level(tmp_path: Path) -> None:
    died = {**_fake_result("ceiling", "limit", [100.0, 400.0]), "levels": []}
    for results in ([died, _fake_result("trio_mlx", "http://h", [90.0, 300.0])], [died]):
        png = write_plot(results, tmp_path / "p.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        png.unlink()


def test_plot_joins_runs_that_share_a_name_into_one_line() -> None:
    sweep = _fake_result("trio_mlx", "http://h", [90.0, 300.0])
    c1 = _fake_result("trio_mlx", "http://h", [95.0, 1.0])
    c1["levels"] = c1["levels"][:1]  # c=1 alone, measured in a call of its own
    ceiling = _fake_result("ceiling", "limit", [100.0, 400.0])
    lines = plot_lines([sweep, ceiling, c1])
    assert list(lines) == ["trio_mlx", "ceiling"]
    assert [lv["concurrency"] for lv in lines["trio_mlx"]] == [1, 1, 8]
    assert sorted(round(lv["output_throughput"]) for lv in lines["trio_mlx"]) == [90, 95, 300]


# ------------------------------------------------------- HTTP mode, real servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeOpenAI:
    """A raw ASGI app streaming OpenAI-style SSE (chunked, keep-alive); misbehaves on purpose.

    Completion requests are numbered as they arrive: n % 4 == 1 answers 503,
    n % 4 == 2 stops two tokens short, n % 4 == 3 ends in an error event.
    """

    def __init__(self, faults: bool) -> None:
        self.faults = faults
        self.count = 0
        self.clients: set[tuple[str, int]] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await self._send(send, 200, b'{"object":"list","data":[{"id":"fake"}]}')
            return
        self.clients.add(tuple(scope["client"]))
        req = json.loads(body)
        assert req["stream"] and req["ignore_eos"] and req["stream_options"]["include_usage"]
        n, self.count = self.count, self.count + 1
        fault = n % 4 if self.faults else 0
        if fault == 1:
            await self._send(send, 503, b'{"error":{"message":"overloaded"}}')
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        tokens = req["max_tokens"] - (2 if fault == 2 else 0)
        for i in range(tokens):
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await self._event(send, chunk)
            await trio.sleep(0.001)
        if fault == 3:
            await self._event(send, {"error": {"message": "actor died"}})
        else:
            await self._event(send, {"choices": [], "usage": {"completion_tokens": tokens}})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @staticmethod
    async def _event(send: Any, obj: Any) -> None:
        data = b"data: " + json.dumps(obj).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})

    @staticmethod
    async def _send(send: Any, status: int, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _hypercorn_config(**opts: Any) -> Any:
    from hypercorn.config import Config

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.loglevel = "WARNING"
    for k, v in opts.items():
        setattr(config, k, v)
    return config


async def _run_against(app: FakeOpenAI, tokenizer: Any, argv: list[str]) -> list[dict[str, Any]]:
    from hypercorn.trio import serve

    config = _hypercorn_config()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, app, config)
            args = _bench._parser().parse_args(["--url", binds[0], "--model", "unused", *argv])
            plan = _bench.levels_and_counts(args)
            warm = _bench.warmup_count(args)
            prompts = make_prompts(tokenizer, warm + sum(n for *_, n in plan), 16)
            levels = await _sweep.run_http(args, plan, prompts[warm:], prompts[:warm])
            nursery.cancel_scope.cancel()
    return levels


def test_request_lengths_are_alike_without_a_spread_and_seeded_within_it() -> None:
    from trio_mlx.bench._prompts import request_lengths

    assert request_lengths(5, 128, 0.0, seed=3) == [128] * 5
    drawn = request_lengths(400, 128, 0.5, seed=3)
    assert drawn == request_lengths(400, 128, 0.5, seed=3)  # every target of a run gets the same
    assert drawn != request_lengths(400, 128, 0.5, seed=4)
    assert min(drawn) >= 64 and max(drawn) <= 192 and len(set(drawn)) > 50
    assert 118 < sum(drawn) / len(drawn) < 138  # centred on --max-tokens
    assert min(request_lengths(50, 2, 0.9)) >= 1
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="spread"):
            request_lengths(3, 8, bad)


def test_a_max_tokens_spread_is_refused_where_every_row_gets_max_tokens() -> None:
    for argv in (["--limit", "--max-tokens-spread", "0.5", "--model", "m"],
                 ["--url", "http://127.0.0.1:9", "--paired", "c.json", "--max-tokens-spread", "0.5", "--model", "m"],
                 ["--engine", "--max-tokens-spread", "1.5", "--model", "m"]):  # fmt: skip
        with pytest.raises(SystemExit, match="max-tokens-spread"):
            _bench.main(argv)


async def test_http_mode_asks_each_request_for_its_drawn_length(tokenizer: Any) -> None:
    from trio_mlx.bench._prompts import request_lengths

    app = FakeOpenAI(faults=False)
    levels = await _run_against(app, tokenizer, ["--concurrency", "2", "--requests-per-level", "8", "--max-tokens",
                                                 "6", "--max-tokens-spread", "0.5", "--quiet"])  # fmt: skip
    (lv,) = levels
    lengths = request_lengths(8, 6, 0.5)
    assert len(set(lengths)) > 1  # the test means something: the lengths differ
    # every answer filled the length it asked for (a request that asked --max-tokens would not)
    assert lv["errors"]["total"] == 0 and lv["completed"] == 8 and lv["output_tokens"] == sum(lengths)


@pytest.mark.parametrize("client", ["raw", "httpx"])
async def test_http_mode_keepalive_and_chunked(client: str, tokenizer: Any) -> None:
    app = FakeOpenAI(faults=False)
    levels = await _run_against(
        app,
        tokenizer,
        [
            "--client",
            client,
            "--concurrency",
            "1,3",
            "--requests-per-level",
            "6",
            "--max-tokens",
            "5",
            "--quiet",
        ],
    )
    assert app.count == 2 + 12  # warm-up and the two levels
    for lv in levels:
        assert lv["errors"]["total"] == 0 and lv["completed"] == 6
        assert lv["output_tokens"] == 30 and lv["tokens_per_event"] == 1.0
        assert lv["ttft_ms"]["n"] == 6 and lv["itl_ms"]["n"] == 6 * 4
    # Keep-alive: the 14 requests used only as many connections as were ever in flight at once.
    assert len(app.clients) == 3


async def test_poisson_arrivals(tokenizer: Any) -> None:
    app = FakeOpenAI(faults=False)
    t0 = trio.current_time()
    levels = await _run_against(
        app,
        tokenizer,
        ["--warmup", "0", "--rate", "inf,100", "--requests-per-level", "10", "--max-tokens", "3",
         "--max-concurrency", "4", "--quiet"],
    )  # fmt: skip
    assert [(lv["concurrency"], lv["rate"]) for lv in levels] == [(None, math.inf), (None, 100.0)]
    for lv in levels:
        assert lv["completed"] == 10 and lv["output_tokens"] == 30
    # Ten exponential gaps at 100/s: about 0.1 s, never instantaneous.
    assert levels[1]["duration_s"] > 0.02
    assert trio.current_time() - t0 < 10
    assert "| inf/s |" in format_table([{"label": "p", "levels": levels}])


@pytest.mark.parametrize("client", ["raw", "httpx"])
async def test_http_mode_counts_every_failure_by_reason(client: str, tokenizer: Any) -> None:
    app = FakeOpenAI(faults=True)
    (lv,) = await _run_against(
        app,
        tokenizer,
        [
            "--client",
            client,
            "--warmup",
            "0",
            "--concurrency",
            "3",
            "--requests-per-level",
            "8",
            "--max-tokens",
            "4",
            "--quiet",
        ],
    )
    assert lv["requests"] == 8 and lv["completed"] == 2
    assert lv["errors"]["by_reason"] == {"http_503": 2, "short_output": 2, "stream_error": 2}
    assert "overloaded" in lv["errors"]["samples"]["http_503"]


async def test_raw_client_retries_an_idle_connection_the_server_closed() -> None:
    from hypercorn.trio import serve

    app = FakeOpenAI(faults=False)
    body = json.dumps(
        {
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            config = _hypercorn_config(keep_alive_timeout=0.1)
            (url,) = await nursery.start(serve, app, config)
            client = _bench_http.RawClient(url)
            first = await _bench_http.stream_request(client, "/v1/completions", body, 3, 10)
            assert first.error is None and len(client._idle) == 1
            await trio.sleep(0.5)  # the server drops the idle keep-alive connection
            second = await _bench_http.stream_request(client, "/v1/completions", body, 3, 10)
            assert second.error is None and second.output_tokens == 3
            assert len(app.clients) == 2  # a fresh connection, the request sent once more
            assert app.count == 2
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_connection_refused_is_an_error_not_a_crash(tokenizer: Any) -> None:
    port = _free_port()  # nothing listens there
    args = _bench._parser().parse_args(
        [
            "--url",
            f"http://127.0.0.1:{port}",
            "--model",
            "unused",
            "--served-model-name",
            "x",
            "--warmup",
            "0",
            "--concurrency",
            "2",
            "--requests-per-level",
            "3",
            "--quiet",
        ]
    )
    with trio.fail_after(10):
        (lv,) = await _sweep.run_http(
            args, _bench.levels_and_counts(args), make_prompts(tokenizer, 3, 8)
        )
    assert lv["errors"]["by_reason"] == {"connect": 3} and lv["completed"] == 0


def test_help_shows_the_plot_table_chat_trace_and_compare_forms() -> None:
    usage = _bench._parser().format_usage()
    for form in ("trio-mlx bench plot A.json", "trio-mlx bench table A.json", "trio-mlx bench chat",
                 "trio-mlx bench trace SERVER_TRACE", "trio-mlx bench compare --out DIR"):
        assert form in usage, usage
