"""Access logs as `trio-mlx serve` writes them: one line per request, ending with its X-Request-Id."""

from __future__ import annotations

import logging
import re

from app_server import (
    CHAT,
    COMPLETIONS,
    chat_body,
    engine_factory,
    open_raw,
    read_response,
    response_complete,
    serve,
    slow_steps,
    until,
)


async def fetch_and_hang_up(port: int, path: str, body: dict | None = None, rid: str | None = None) -> bytes:
    """Like curl: read the whole response, close the connection at once (keep-alive unused)."""
    sock = await open_raw(port, path, body, headers={"X-Request-Id": rid} if rid else None)
    raw = await read_response(sock)
    sock.close()
    assert response_complete(raw), raw[-300:]
    return raw


def response_id(raw: bytes) -> str:
    m = re.search(rb"x-request-id: (\S+)", raw, re.I)
    assert m, raw[:300]
    return m.group(1).decode()


async def test_one_line_per_request_with_its_request_id(tiny_model_fp32, caplog):
    caplog.set_level(logging.INFO, logger="hypercorn.access")
    factory = engine_factory(fault_hook=slow_steps(0.003))
    async with serve(tiny_model_fp32, access_log=True, factory=factory) as server:
        ids = []
        for i in range(12):  # clients that close as soon as they have the answer (hypercorn logged twice)
            ids.append(response_id(await fetch_and_hang_up(server.port, "/health")))
            if i % 3 == 0:
                raw = await fetch_and_hang_up(server.port, COMPLETIONS, {"prompt": "a", "max_tokens": 3})
                ids.append(response_id(raw))
                raw = await fetch_and_hang_up(server.port, CHAT, chat_body(max_tokens=3, stream=True))
                assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
                ids.append(response_id(raw))
        raw = await fetch_and_hang_up(server.port, "/v1/models", rid="client-chosen-id")
        ids.append(response_id(raw))
        assert ids[-1] == "client-chosen-id"
        async with server.client() as client:  # a keep-alive client
            for path in ("/ready", "/nope", "/metrics"):
                ids.append((await client.get(path)).headers["x-request-id"])
            r = await client.post(CHAT, json={"messages": "not a list"})
            assert r.status_code == 400
            ids.append(r.headers["x-request-id"])
        # A client that really leaves mid-stream: its line has no status, but has its id.
        sock = await open_raw(server.port, CHAT, chat_body(max_tokens=900, stream=True, ignore_eos=True),
                              headers={"X-Request-Id": "left-early"})
        await until(lambda: server.engine.statistics().decoding == 1)
        sock.close()
        await until(lambda: any(r.getMessage().endswith(" left-early") for r in caplog.records))

    lines = [r.getMessage() for r in caplog.records if r.name == "hypercorn.access"]
    assert len(ids) == len(set(ids)) == 12 + 4 * 2 + 1 + 4
    for rid in ids:
        mine = [line for line in lines if line.endswith(" " + rid)]
        assert len(mine) == 1, (rid, mine)
        assert re.search(r'" (200|400|404) ', mine[0]), mine[0]
    [early] = [line for line in lines if line.endswith(" left-early")]
    assert '"POST /v1/chat/completions 1.1" - ' in early
    assert len(lines) == len(ids) + 1, "\n".join(lines)


async def test_request_ids_are_unique_and_a_bad_client_id_is_replaced(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        got = {(await client.get("/health")).headers["x-request-id"] for _ in range(20)}
        assert len(got) == 20 and all(g.startswith("req-") for g in got)
        r = await client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 1},
                              headers={"X-Request-Id": "x" * 500})
        assert r.headers["x-request-id"] == r.json()["id"]  # too long: the completion id instead
        sock = await open_raw(server.port, "/health", headers={"X-Request-Id": "bad\x7fid"})
        raw = await read_response(sock)
        sock.close()
        assert response_id(raw).startswith("req-")
