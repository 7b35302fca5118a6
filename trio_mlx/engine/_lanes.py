"""Where a prompt is tokenized: on the event loop, in a worker thread, or in the long lane.

A fast tokenizer's encode releases the GIL for most of its work, but it occupies the
thread that runs it: on the event loop, every stream's tokens wait for it (docs/design.md,
rule 6). A short prompt costs about the thread hop and is tokenized on the event loop; a
longer one in a worker thread (a limiter of half the cores, shared by every engine of the
process); a very long one in a lane of its own, one at a time with a few waiting, so that
it never holds up the others, and the heap it grew goes back to the system after.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from .._errors import QueueFullError
from ._limiters import RunLimiter, half_the_cores

# The worker threads long prompts are tokenized in: half the cores, for every engine; the very
# long ones, one at a time.
tokenizer_limiter = RunLimiter("trio_mlx_tokenizer_limiter", half_the_cores)
_big_tokenizer_limiter = RunLimiter("trio_mlx_big_tokenizer_limiter", lambda: 1)
# Prompts longer than this many characters (~250 tokens) are tokenized in a worker thread so
# the event loop keeps serving: past it, encoding inline costs the loop more than the hop, and
# prompts arriving together push the running streams' tokens apart (BENCHMARKS.md, "What the
# runtime does").
_THREAD_TOKENIZE_CHARS = 1024
# For those two choices a chat message counts this many characters besides its text: its
# template costs about that much tokenizing (SmolLM2's template on the 2-core CPU box:
# 1,000 empty messages took 18 ms, 4,096 characters of text in one message 1.9 ms), so a
# request of many empty messages is not templated on the event loop.
_MESSAGE_CHARS = 40
# Prompts longer than this (a long document, not a chat turn) take a lane of their own, one at
# a time, so a few of them never keep ordinary long prompts waiting; at most
# _BIG_TOKENIZE_WAITING of them wait (more: 429). Judgement calls.
_BIG_TOKENIZE_CHARS = 256 * 1024
_BIG_TOKENIZE_WAITING = 8

Encode = Callable[[str, Any, "Mapping[str, Any] | None"], list[int]]




def _trim_memory() -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise): after a prompt of
    megabytes, the process's resident size returns to where it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


class TokenizingLanes:
    """One engine's way into the three lanes; counts the very long prompts that wait."""

    def __init__(self) -> None:
        self.big_waiting = 0

    async def encode(self, encode: Encode, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None,
                     chars: int) -> list[int]:
        """`encode(kind, value, template_kwargs)` in the lane for a prompt of `chars` characters."""
        work = chars + (_MESSAGE_CHARS * len(value) if kind == "chat" and isinstance(value, Sequence) else 0)
        if work > _BIG_TOKENIZE_CHARS:
            return await self._encode_big(encode, kind, value, template_kwargs)
        if work > _THREAD_TOKENIZE_CHARS:
            return await trio.to_thread.run_sync(encode, kind, value, template_kwargs, limiter=tokenizer_limiter())
        return encode(kind, value, template_kwargs)

    async def _encode_big(self, encode: Encode, kind: str, value: Any,
                          template_kwargs: Mapping[str, Any] | None) -> list[int]:
        """Very long prompts are tokenized in a lane of their own (one at a time, a few waiting),
        so that they never hold up the ordinary ones; memory goes back to the system after."""
        if self.big_waiting >= _BIG_TOKENIZE_WAITING:
            raise QueueFullError(f"too many very long prompts ({self.big_waiting}) are waiting to be "
                                 "tokenized; retry shortly", retry_after=5.0)

        def job() -> list[int]:
            try:
                return encode(kind, value, template_kwargs)
            finally:
                _trim_memory()

        self.big_waiting += 1
        try:
            return await trio.to_thread.run_sync(job, limiter=_big_tokenizer_limiter())
        finally:
            self.big_waiting -= 1
