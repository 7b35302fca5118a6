"""A generation request's body to its validated request, with the cheap bounds first.

Parsing and validating JSON is CPU work that holds the GIL: eight concurrent
3.4 MB bodies of 10^5 messages, validated on the event loop, stalled every
other request for seconds. So:

- the message count is checked on the parsed JSON before pydantic builds a
  model per message (`max_messages`, and never more messages than the
  context has tokens: every turn renders at least one), and a token-id
  prompt's length before its ids are validated (never more than the context);
- bodies over `LARGE_BODY` bytes are parsed and validated in a worker thread,
  one at a time (`_LIMITER`), so the event loop waits for at most one of them
  at a time instead of running them all;
- large allocations get pages of their own (`return_large_allocations`: a
  fixed glibc mmap threshold), and after a large body the process hands
  freed heap memory back to the system (`trim_soon`), so resident memory
  returns to its level before it.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from trio.lowlevel import RunVar

from ._http import HTTPError, parse_json

# Bodies larger than this are parsed off the event loop. Below it, parsing and validating take
# well under a millisecond and the thread hop would cost more. Judgement.
LARGE_BODY = 256 * 1024

_LIMITER: RunVar[trio.CapacityLimiter] = RunVar("trio_mlx_intake_limiter")
_TRIM: RunVar[trio.Event] = RunVar("trio_mlx_trim_wanted")

T = TypeVar("T")


def _limiter() -> trio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        _LIMITER.set(limiter := trio.CapacityLimiter(1))
        return limiter


def check_counts(obj: Any, max_messages: int) -> None:
    """400 for more messages than allowed, before any of them is validated. Counted as
    each API's request becomes chat messages: chat and Anthropic `messages` (an Anthropic
    `tool_result` block is a message of its own), the Responses API's `input` items."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    param, count = "messages", 0
    if isinstance(messages, list):
        count = len(messages)
        for msg in messages if count <= max_messages else ():
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list):
                count += sum(1 for b in content if isinstance(b, dict) and b.get("type") == "tool_result")
    elif isinstance(items := obj.get("input") if isinstance(obj, dict) else None, list):
        param, count = "input", len(items)
    if count > max_messages:
        raise HTTPError(400, f"a request may have at most {max_messages} messages, this one has "
                        f"{count}", param=param, code="too_many_messages")


def check_prompt_ids(obj: Any, context_length: int) -> None:
    """400 for a token-id prompt (`/v1/completions`) of more ids than the context holds, from
    its length alone, before pydantic validates the ids: 5.3 M ids held the GIL ~2.2 s in
    validation, then ~1.4 s in the engine's check on the event loop."""
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not context_length or not isinstance(prompt, list):
        return
    count = len(prompt)  # of ids, or of prompts (more than one is refused after validation)
    if count <= context_length:
        count = max((len(p) for p in prompt if isinstance(p, list)), default=count)
    if count > context_length:
        raise HTTPError(400, f"this model's maximum context length is {context_length} tokens; the prompt "
                        f"has {count} token ids", param="prompt", code="context_length_exceeded")


def _parse(body: bytes, into: Callable[[dict[str, Any]], T], max_messages: int, context_length: int) -> T:
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
    # A refusal's frames (this one holds the parsed body: a 5 M-id prompt is ~50 MB) go with its
    # response: `_pump.refuse` drops the tracebacks that would keep them in a reference cycle.
    check_counts(obj, max_messages)
    check_prompt_ids(obj, context_length)
    return into(obj)


async def parse_request(body: bytes, into: Callable[[dict[str, Any]], T], *, max_messages: int,
                        context_length: int = 0) -> T:
    """The body's JSON object, bounds checked, then `into(obj)` (a model's `model_validate`,
    an API's translation), in a worker thread for a large body; an HTTPError (400) or
    pydantic ValidationError if it is not a valid request."""
    limit = min(max_messages, context_length or math.inf)
    if len(body) <= LARGE_BODY:
        return _parse(body, into, int(limit), context_length)
    return await off_loop(functools.partial(_parse, body, into, int(limit), context_length))


async def off_loop(work: Callable[[], T]) -> T:
    """`work()` in the intake's worker thread, one at a time, so the event loop keeps serving
    meanwhile; the memory it took is handed back soon after. For a large body's parsing,
    and a large response's building (16 choices of 1,000 tokens with 20 top logprobs each
    are a 22 MB body: 0.8 s of building)."""
    try:
        return await trio.to_thread.run_sync(work, limiter=_limiter())
    finally:
        trim_soon()


def trim_soon() -> None:
    """Ask `trimmer` to hand freed memory back once the large request is gone."""
    try:
        _TRIM.get().set()
    except LookupError:
        pass


async def trimmer(delay: float = 1.0) -> None:
    """Runs for the app's life: after large bodies, once things have settled for `delay`
    seconds, `malloc_trim` (glibc keeps freed heap pages otherwise; ~ms, off the loop). A
    large body that comes while a trim waits asks for the next one: the trim may run while
    that body is still held."""
    wanted = trio.Event()
    _TRIM.set(wanted)
    while True:
        await wanted.wait()
        wanted = trio.Event()
        _TRIM.set(wanted)
        await trio.sleep(delay)
        await trio.to_thread.run_sync(malloc_trim)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# Allocations at least this large get pages of their own (mmap), handed back to the system when
# freed. glibc's own threshold starts at 128 KiB but rises after large frees (up to 32 MiB), after
# which a megabytes-long body's memory stays in the heap. Judgement: well above any SSE chunk.
MMAP_THRESHOLD = 256 * 1024


def return_large_allocations() -> None:
    """Fix glibc's mmap threshold, so that a large body's memory goes back once freed."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (AttributeError, OSError):  # not glibc
        pass


def malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to do
        pass
