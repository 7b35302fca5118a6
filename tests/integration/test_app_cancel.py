"""Clients that go away or stop reading: their sequences leave the batch, others are unaffected."""

from __future__ import annotations

import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    chat_body,
    disconnect_mid_decode,
    engine_factory,
    open_raw,
    serve,
    slow_steps,
    until,
)


async def read_until_eof(sock: trio.socket.SocketType) -> bytes:
    out = b""
    with trio.fail_after(10):
        while chunk := await sock.recv(1 << 16):
            out += chunk
    return out


async def test_disconnect_mid_prefill_frees_the_slot(tiny_model_fp32):
    records = []
    async with serve(tiny_model_fp32, max_batch=2, prefill_batch=1, prefill_step=4) as server:
        server.app.observers.append(records.append)
        engine = server.engine
        for stream in (True, False):
            before = engine.statistics().aborts_by_stage.get("prefill", 0)
            sock = await open_raw(server.port, COMPLETIONS, {"prompt": [5 + i % 200 for i in range(600)],
                                                                 "max_tokens": 4, "stream": stream})
            await until(lambda: engine.statistics().prefilling == 1)
            sock.close()
            await until(lambda: engine.statistics().active == 0, within=5)
            stats = engine.statistics()
            assert stats.aborts_by_stage["prefill"] == before + 1
            assert stats.queued == stats.prefilling == stats.decoding == 0
        await until(lambda: len(records) == 2)
        assert [r.outcome for r in records] == ["disconnect", "disconnect"]
        async with server.client() as client:
            assert (await client.post(COMPLETIONS, json={"prompt": "after", "max_tokens": 2})).status_code == 200


async def assert_disconnects_free_the_slot(model, path: str, body: dict) -> None:
    """A client that hangs up mid-decode on `path`, streamed and not: its row leaves at the
    decode stage, the request is recorded as a disconnect, and no stream is left behind
    (the other wire APIs' tests call this)."""
    records: list = []
    async with serve(model, factory=engine_factory(fault_hook=slow_steps(0.005))) as server:
        server.app.observers.append(records.append)
        engine = server.engine
        for stream in (True, False):
            before = engine.statistics().aborts_by_stage.get("decode", 0)
            sock = await open_raw(server.port, path, {**body, "stream": stream})
            await until(lambda: engine.statistics().decoding == 1 and engine.statistics().generated_tokens > 0)
            sock.close()
            await until(lambda: engine.statistics().active == 0, within=5)
            assert engine.statistics().aborts_by_stage["decode"] == before + 1
        await until(lambda: len(records) == 2)
        assert [(r.endpoint, r.outcome) for r in records] == [(path, "disconnect")] * 2
        assert not server.app.pump.streams


async def test_disconnect_mid_decode_frees_the_slot_within_a_step(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, factory=factory) as server:
        engine = server.engine
        for stream in (True, False):
            await disconnect_mid_decode(engine, server.port, stream=stream)
        async with server.client() as client:
            assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


async def test_a_client_that_stops_reading_is_aborted_after_the_stall_timeout(tiny_model_fp32):
    records = []
    factory = engine_factory(fault_hook=slow_steps(0.003))
    async with serve(tiny_model_fp32, stall_timeout=0.5, factory=factory) as server, server.client() as client:
        server.app.observers.append(records.append)
        engine = server.engine
        # Big chunks (20 alternatives per token) and a tiny receive window fill the socket buffers fast.
        body = chat_body(max_tokens=950, stream=True, ignore_eos=True, logprobs=True, top_logprobs=20)
        sock = await open_raw(server.port, CHAT, body, rcvbuf=4096)
        await until(lambda: engine.statistics().decoding == 1)
        t0 = trio.current_time()
        # While that client is stuck, the batch keeps serving others at full speed.
        r = await client.post(CHAT, json=chat_body(max_tokens=20, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        await until(lambda: engine.statistics().aborts_by_stage.get("decode", 0) == 1, within=8)
        waited = trio.current_time() - t0
        await until(lambda: engine.statistics().active == 0, within=2)  # applied at the next step
        stats = engine.statistics()
        assert stats.generated_tokens < 950 + 20, stats
        assert waited < 5
        await until(lambda: any(r.outcome == "stall" for r in records))
        # The server closed that connection: reading drains the buffers and then sees EOF.
        received = await read_until_eof(sock)
        assert received.startswith(b"HTTP/1.1 200")
        sock.close()
        assert not server.app.pump.streams
        assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


async def test_many_disconnects_leave_nothing_behind(tiny_model_fp32):
    async with serve(tiny_model_fp32, max_batch=8) as server, server.client() as client:
        engine = server.engine

        async def hang_up(i: int) -> None:
            sock = await open_raw(server.port, CHAT if i % 2 else COMPLETIONS,
                                      {"prompt": f"p{i}", "messages": [{"role": "user", "content": f"m{i}"}],
                                       "max_tokens": 500, "stream": i % 3 != 0, "ignore_eos": True})
            await trio.sleep(0.01 * (i % 7))
            sock.close()

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(hang_up, i)
        # every request ends within the bound, wherever its client left it: a handler that had
        # just submitted when the others were gone holds one queued request until it sees its
        # disconnect (the actor's `active` and the completion streams can read 0 before that)
        def drained() -> bool:
            s = engine.statistics()
            return s.active == s.queued == s.prefilling == s.decoding == 0 and not server.app.pump.streams

        await until(drained, within=10)
        r = await client.post(COMPLETIONS, json={"prompt": "still fine", "max_tokens": 5, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
