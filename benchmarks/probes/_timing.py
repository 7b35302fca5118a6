"""One engine request timed as the probes report it (imported by the probes beside it).

Decode tokens/s is the completion tokens after the first over the time after the first token;
TTFT the time to the first token, from the call."""

from __future__ import annotations

import time
from typing import Any

import trio_mlx


async def timed(request: Any) -> dict[str, Any]:
    """`request` (an engine's `generate` or `chat` stream, not yet entered) run to its end:
    tokens, ttft, decode_tps, first and end (perf_counter), and the Finished event's error."""
    t0 = time.perf_counter()
    first: float | None = None
    async with request as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta) and first is None and ev.token_ids:
                first = time.perf_counter()
            elif isinstance(ev, trio_mlx.Finished):
                end = time.perf_counter()
                n = ev.usage.completion_tokens
                start = first or end
                return {"tokens": n, "ttft": start - t0, "decode_tps": (n - 1) / max(1e-9, end - start),
                        "first": start, "end": end, "error": ev.error}
    raise AssertionError("no Finished")
