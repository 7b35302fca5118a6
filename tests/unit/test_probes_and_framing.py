"""Smaller hardening: the watchdog after idle, readiness while stalled, ambiguous framing, the listen
backlog, and a bound on what a client that stopped reading leaves buffered. A real hypercorn on
127.0.0.1 each time.

Here framing and the backlog (over the fake actor); the probes and a reader that stopped:
tests/integration/test_probes_and_framing.py.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import (
    COMPLETIONS,
    engine_factory,
    fake_factory,
    open_raw,
    read_response,
    serve,
    until,
)

from trio_mlx.actor import FakeActor
from trio_mlx.server._serve import build_parser, hypercorn_config, settings_from_args
from trio_mlx.server._settings import Settings

pytestmark = pytest.mark.timeout(60)


async def test_content_length_with_transfer_encoding_is_refused_and_closed(tiny_model_fp32: Path) -> None:
    async with serve(tiny_model_fp32, factory=fake_factory()) as server:
        body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        sock = await open_raw(server.port, COMPLETIONS, chunked,
                              headers={"Content-Length": str(len(chunked)), "Transfer-Encoding": "chunked"})
        raw = await read_response(sock)
        assert raw.startswith(b"HTTP/1.1 400") and b"invalid_framing" in raw, raw[:300]
        assert b"connection: close" in raw.lower()
        with trio.fail_after(5):
            while await sock.recv(65536):  # the server closes the connection (RFC 9112, 6.3)
                pass
        sock.close()
        # a plain request on a fresh connection is served
        sock = await open_raw(server.port, COMPLETIONS, body)
        assert (await read_response(sock)).startswith(b"HTTP/1.1 200")
        sock.close()


async def test_framing_refused_with_a_request_pipelined_behind_is_answered_without_a_traceback(
        tiny_model_fp32: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Hypercorn closed the socket while the 400 was being written (h11 took the pipelined
    # bytes behind a `Connection: close` answer as an error): the client got no response and
    # the log a trio.BusyResourceError traceback, for every such request.
    async with serve(tiny_model_fp32, factory=fake_factory()) as server:
        body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        pipelined = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        for _ in range(5):
            sock = await open_raw(server.port, COMPLETIONS, chunked + pipelined,
                                  headers={"Content-Length": str(len(chunked)), "Transfer-Encoding": "chunked"})
            raw = b""
            with trio.fail_after(5):
                while chunk := await sock.recv(65536):  # the 400, then the server closes
                    raw += chunk
            sock.close()
            assert raw.startswith(b"HTTP/1.1 400") and b"invalid_framing" in raw, raw[:300]
            assert raw.count(b"HTTP/1.1") == 1, raw  # the pipelined request was not served
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def test_the_listen_backlog_is_a_setting_with_a_larger_default() -> None:
    assert hypercorn_config(Settings()).backlog == 2048  # hypercorn's own: 100
    args = build_parser().parse_args(["--backlog", "4096"])
    assert hypercorn_config(settings_from_args(args)).backlog == 4096


async def test_a_reader_that_stops_is_cut_by_what_all_its_choices_left_unread(tiny_model_fp32: Path) -> None:
    # n > 1 drained every choice into an unbounded channel, where the unread cap never looked:
    # 16 requests of n=16 with logprobs held 32 MB for one client until the 30 s stall timeout.
    records: list[Any] = []
    slow = partial(FakeActor, step_seconds=0.005)  # 600 steps take 3 s or more: still decoding when cut
    async with serve(tiny_model_fp32, factory=engine_factory(actor=slow), stall_timeout=30,
                     max_unread_tokens=64, max_batch=8) as server:
        server.app.observers.append(records.append)
        body = {"prompt": "a", "max_tokens": 600, "n": 4, "stream": True, "logprobs": 5}
        sock = await open_raw(server.port, COMPLETIONS, body, rcvbuf=4096)
        t0 = trio.current_time()
        await until(lambda: any(r.outcome == "stall" for r in records), within=15)
        assert trio.current_time() - t0 < 10  # long before the 30 s stall timeout
        assert server.engine.statistics().aborts_by_cause.get("stall") == 4  # every choice
        sock.close()


async def _probe_during_a_long_prefill(model: Path, chunk: int) -> list[int]:
    """/health's statuses while a prompt of 900 tokens prefills at 1 ms a token (0.9 s of
    prefill) under a 0.5 s watchdog, in chunks of `chunk` tokens (0: in one step)."""
    actor = partial(FakeActor, prefill_seconds=0.001, prefill_chunk=chunk)
    statuses: list[int] = []
    async with serve(model, factory=engine_factory(actor=actor), watchdog_seconds=0.5) as server, \
            server.client() as client:
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def ask() -> None:
                r = await client.post(COMPLETIONS, json={"prompt": [5] * 900, "max_tokens": 2})
                assert r.status_code == 200, r.text
                done.set()

            nursery.start_soon(ask)
            while not done.is_set():
                statuses.append((await client.get("/health")).status_code)
                await trio.sleep(0.05)
    return statuses


async def test_health_is_not_stalled_while_a_long_prefill_reports_its_chunks(tiny_model_fp32: Path) -> None:
    # Each prefill chunk is a step with its report, which is the progress the watchdog wants
    # (the actor cuts an idle batch's long prefill so: `_actor.PROGRESS_SECONDS`). In one
    # step of the same length, "stalled" once the watchdog's 0.5 s pass: eight ~1.9k-token
    # prompts into an idle CPU server were one step of ~160 s, stalled from 30 s on.
    chunked = await _probe_during_a_long_prefill(tiny_model_fp32, chunk=128)
    assert chunked and set(chunked) == {200}, chunked
    whole = await _probe_during_a_long_prefill(tiny_model_fp32, chunk=0)
    assert 503 in whole, whole
