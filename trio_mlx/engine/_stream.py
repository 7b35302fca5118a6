"""One request's stream of events: `RequestStream`, and the port it reaches its engine through.

A stream is made by `Engine.generate` / `Engine.chat`. Entering it checks the
request's tools and response format, has the engine tokenize and fit the prompt
(`StreamPort.prepare`), compiles the grammar and submits; iterating it turns the
tokens the engine delivers into `TextDelta`s, tool calls and one `Finished`
(detokenizing, stop strings, held logprobs); leaving it aborts the sequence
(docs/design.md, rule 4). It sees its engine only through `StreamPort`: the
engine's registry and lifecycle stay the engine's own.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from .._errors import InvalidRequestError
from ..actor import Grammar, SamplingParams, TokenOut
from ._events import (
    Event,
    Finished,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCalls,
    Usage,
)
from ._options import Checked, GenerationOptions
from ._registry import Request, Terminal
from ._structure import NO_STRUCTURE, Structure, check_structure, compile_structure
from ._text import HeldLogprobs, StopMatcher, keep_leading_space


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the actor: its prompt, its answer's limit, its checked options and
    every stop token (the request's own, and the model's EOS unless it ignores them)."""

    prompt: list[int]
    max_tokens: int
    clamped: bool  # `fit_max_tokens` cut max_tokens to the context's end
    checked: Checked
    stop_token_ids: frozenset[int]


class StreamPort(Protocol):
    """What a request's stream needs from its engine, and all it reaches of it."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def model_path(self) -> os.PathLike[str] | None: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...
    @property
    def special_ids(self) -> frozenset[int]: ...

    async def prepare(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None,
                      options: GenerationOptions) -> Prepared:
        """Check the options and the engine's state, tokenize, fit the answer's limit."""
        ...

    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: frozenset[int],
               grammar: Grammar | None, cache_salt: str = "", adapter: str | None = None) -> Request:
        """Register the request and queue its `Submit` for the actor (`cache_salt`: its part
        of the prompt cache; `adapter`: the named LoRA adapter it runs with)."""
        ...

    def check_open(self) -> None:
        """Raise the engine's error if it takes no requests now (not ready, restarting, closed)."""
        ...

    def abort(self, req: Request, cause: str) -> None:
        """Forget the request; the actor drops its sequence (sync, non-blocking)."""
        ...


def _template_kwargs(o: GenerationOptions, structure: Structure) -> dict[str, Any] | None:
    """The chat template's extra arguments: the caller's, the prefill's and the tools'."""
    out = {**(o.chat_template_kwargs or {})}
    if o.continue_final_message:
        out["continue_final_message"] = True
    out.update(structure.template_kwargs())
    return out or None


class RequestStream:
    """One request's events. `async with` submits it; iterate for `TextDelta`s then one
    `Finished`; leaving the block early aborts the sequence on the actor."""

    def __init__(self, port: StreamPort, kind: str, prompt: Any, options: GenerationOptions,
                 prepared: tuple[Structure, Grammar | None] | None = None):
        self._port = port
        self._kind = kind  # "chat" (messages) or "text" (a string or token ids)
        self._prompt = prompt
        self.options = options  # as given: checked when the stream is entered
        self._prepared = prepared  # a sibling's checked structure and grammar (`again`)
        self._tool_stream: Any = None  # an `_tools.ToolCallStream` when the request has tools
        self._called = False  # whether it reported a call
        self.structure: Structure = NO_STRUCTURE  # the request's checked tools and response format
        self.grammar: Grammar | None = None  # what the actor enforces, if anything
        self._req: Request | None = None
        self._recv: trio.MemoryReceiveChannel[Any] | None = None
        self._pending: collections.deque[Event] = collections.deque()
        self._done = False
        self.prompt_tokens: list[int] = []
        self.completion_tokens = 0
        self.max_tokens = 0  # the answer's limit, once entered
        self.clamped = False  # `fit_max_tokens` cut max_tokens to the context's end

    async def __aenter__(self) -> RequestStream:
        port = self._port
        port.check_open()
        o, chat = self.options, self._kind == "chat"
        if self._prepared is None:
            structure = check_structure(port.tokenizer, o, chat=chat)
        else:
            structure = self._prepared[0]
        template_kwargs = _template_kwargs(o, structure) if chat else None
        p = await port.prepare(self._kind, self._prompt, template_kwargs, o)
        if self._prepared is None:
            grammar = await compile_structure(port.tokenizer, port.model_path, structure)
        else:
            grammar = self._prepared[1]
        continuing = chat and bool((template_kwargs or {}).get("continue_final_message"))
        stop_ids = p.stop_token_ids
        if grammar is not None:
            if continuing:
                raise InvalidRequestError("a continued message (continue_final_message, a prefill) cannot be "
                                          "held to response_format or a required tool_choice: the grammar "
                                          "would start mid-message", param="messages")
            from ._grammar import check_max_tokens

            check_max_tokens(grammar, p.max_tokens)
            stop_ids = stop_ids | port.eos_ids  # the grammar ends on EOS, ignore_eos or not
        self.structure, self.grammar = structure, grammar
        self._tool_stream = structure.tool_stream(port.tokenizer, p.prompt, grammar)
        self.prompt_tokens = p.prompt
        self.max_tokens = p.max_tokens
        self.clamped = p.clamped
        self._sampling = p.checked.sampling
        self._stop_ids = stop_ids
        self._stopper = StopMatcher(p.checked.stop_strings)
        self._detok = port.tokenizer.detokenizer
        if not chat or continuing:  # a continuation: " Paris" after "is"
            keep_leading_space(self._detok)
        self._held_logprobs = HeldLogprobs()
        self._hidden = port.special_ids
        self._req = port.submit(p.prompt, p.max_tokens, p.checked.sampling, stop_ids, grammar, p.checked.cache_salt,
                                p.checked.adapter)
        self._recv = self._req.recv
        return self

    def again(self, **fields: Any) -> RequestStream:
        """Another request for the same prompt, tools and response format as this
        entered one (tokenized and compiled once), with these `GenerationOptions` fields
        changed: OpenAI's `n` choices, each with its own seed."""
        if self._req is None:
            raise RuntimeError("again() needs a stream that was entered")
        options = dataclasses.replace(self.options, **{**_AGAIN_RESET, **fields})
        return RequestStream(self._port, "text", list(self.prompt_tokens), options,
                             (self.structure, self.grammar))

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, cause: str = "cancelled") -> None:
        """End the request; if it is still running, abort it, counted under `cause`
        (statistics().aborts_by_cause). Synchronous and non-blocking: safe in any
        `finally` (docs/design.md, rule 4)."""
        if self._req is not None:
            self._port.abort(self._req, cause)
        if self._recv is not None:
            self._recv.close()
        self._done = True

    @property
    def stage(self) -> str:
        """"queued", "prefill", "decode" or "done"."""
        req = self._req
        return req.stage if req is not None and not req.ended.is_set() else "done"

    @property
    def cached_tokens(self) -> int:
        """The prompt's tokens the prompt cache gave, once the actor admitted the request (0
        before, and for a miss): known by the request's first token."""
        return self._req.cached if self._req is not None else 0

    @property
    def unread(self) -> int:
        """Tokens the engine has delivered that this stream's reader has not taken yet."""
        return self._recv.statistics().current_buffer_used if self._recv is not None and not self._done else 0

    async def wait_ended(self) -> None:
        """Return once the request has ended (at once if it has): for a reader that
        paces itself, so that a stream's last tokens and its end are never held back."""
        if not self._done and self._req is not None:
            await self._req.ended.wait()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        return await self.next_event()

    async def next_event(self, not_before: float = 0.0) -> Event:
        """The next event, as `__anext__`. With `not_before` (trio's clock), a token that
        arrives earlier waits until then, or until the request ends, so that the tokens
        after it join its event: how a reader paces its events. A token that arrives
        later goes out at once, with no timer set: each timer that expires costs the event
        loop a cancellation, and the GIL it holds meanwhile is the thread actor's
        (docs/design.md, rule 7). A stream's last token and its end are never held."""
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._done or self._recv is None:
                raise StopAsyncIteration
            try:
                item = await self._recv.receive()
            except trio.EndOfChannel:
                self._end("error", error="the engine dropped this request")
                continue
            if not_before and self._req is not None and not _last(item) and trio.current_time() < not_before:
                with trio.move_on_at(not_before):
                    await self._req.ended.wait()
            batch = [item]
            while True:  # tokens already waiting go out together (adaptive coalescing)
                try:
                    batch.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break  # Closed: close() ran (another task) after this task was handed `item`
            self._process(batch)

    def _process(self, batch: list[Any]) -> None:
        ids: list[int] = []
        lps: list[TokenLogprob] | None = [] if self._sampling.logprobs else None
        text: list[str] = []
        detok, stopper = self._detok, self._stopper
        held = self._held_logprobs  # logprobs go out with their text (stop strings hold both)
        for item in batch:
            if isinstance(item, Terminal):
                text.append(stopper.flush())
                if lps is not None:
                    lps += held.rest()
                self._emit(text, ids, lps)
                self._end(item.finish_reason, error=item.error)
                return
            assert isinstance(item, TokenOut)
            tok = item.token
            self.completion_tokens += 1
            ids.append(tok)
            ends_on_stop_token = item.finish_reason == "stop" and tok in self._stop_ids
            if lps is not None and item.logprob is not None and not ends_on_stop_token:
                held.token(self._logprob(item))
            if not ends_on_stop_token and tok not in self._hidden:
                detok.add_token(tok)
            if item.finish_reason is not None:
                detok.finalize()
            segment = released = detok.last_segment
            if stopper:
                released, matched = stopper.feed(segment)
                if matched is not None:
                    text.append(released)
                    if lps is not None:
                        lps += held.text(segment, released)  # the stop string's tokens stay out
                    self._emit(text, ids, lps)
                    if self._req is not None:
                        self._port.abort(self._req, "stop_string")
                    self._end("stop", stop=matched)
                    return
            text.append(released)
            if lps is not None:
                lps += held.text(segment, released)
            if item.finish_reason is not None:
                text.append(stopper.flush())
                if lps is not None:
                    lps += held.rest()
                self._emit(text, ids, lps)
                self._end(item.finish_reason, stop=tok if ends_on_stop_token else None)
                return
        self._emit(text, ids, lps)

    def _logprob(self, item: TokenOut) -> TokenLogprob:
        from ..models._token_bytes import (  # imported where used, as models is
            token_bytes,
            token_text,
        )

        raw = token_bytes(self._port.tokenizer)
        pairs = item.top_logprobs or ()
        top_raw = tuple(raw(i) for i, _ in pairs)
        top = tuple((i, token_text(r), lp) for (i, lp), r in zip(pairs, top_raw, strict=True))
        mine = raw(item.token)
        return TokenLogprob(item.token, token_text(mine), float(item.logprob or 0.0), top, mine, top_raw)

    def _emit(self, text: list[str], ids: list[int], lps: list[TokenLogprob] | None) -> None:
        joined = "".join(text)
        if self._tool_stream is not None:
            self._emit_split(self._tool_stream.feed(joined) if joined else None, ids, lps)
        elif joined or ids:
            self._pending.append(TextDelta(joined, tuple(ids), tuple(lps) if lps is not None else None))

    def _emit_split(self, delta: Any, ids: list[int], lps: list[TokenLogprob] | None) -> None:
        """A ToolCallStream's delta, in its text's order: reasoning and the content before
        any call as one TextDelta (with the token ids), then the calls' `ToolCallDelta`s,
        whole calls (`ToolCalls`) and later content. Call text the family's parser
        could not read is content: nothing the model wrote is lost (vLLM does the same)."""
        items: tuple[Any, ...] = delta.items if delta is not None else ()
        lead = 0
        while lead < len(items) and type(items[lead]) is str:
            lead += 1
        content = "".join(items[:lead])
        reasoning = delta.reasoning if delta is not None else ""
        if content or reasoning or ids:
            self._pending.append(TextDelta(content, tuple(ids), tuple(lps) if lps is not None else None, reasoning))
        whole: list[ToolCall] = []
        for item in items[lead:]:
            if type(item) is ToolCall:
                whole.append(item)
                continue
            if whole:
                self._called = True
                self._pending.append(ToolCalls(tuple(whole)))
                whole = []
            if type(item) is ToolCallDelta:
                self._pending.append(item)
            else:  # content after a call, or a refused call's text
                self._pending.append(TextDelta(item if type(item) is str else item.text, ()))
        if whole:
            self._called = True
            self._pending.append(ToolCalls(tuple(whole)))

    def _end(self, reason: str, *, error: str | None = None, stop: str | int | None = None) -> None:
        if self._tool_stream is not None:
            stream, self._tool_stream = self._tool_stream, None
            self._emit_split(stream.finish(), [], None)
            if self._called and reason == "stop":
                reason = "tool_calls"
        req = self._req
        usage = Usage(len(self.prompt_tokens), self.completion_tokens, req.cached if req is not None else 0,
                      req.drafted if req is not None else 0, req.accepted if req is not None else 0)
        self._pending.append(Finished(reason, usage, error, stop))  # type: ignore[arg-type]
        self._done = True
        if self._recv is not None:
            self._recv.close()


def _last(item: Any) -> bool:
    """Whether a delivered item ends its request (its Terminal, or its last token)."""
    return isinstance(item, Terminal) or item.finish_reason is not None


# What `again` leaves out of its options: the sibling's structure comes compiled, its prompt as token ids.
_AGAIN_RESET: dict[str, Any] = dict(tools=None, tool_choice=None, parallel_tool_calls=True, response_format=None,
                                    continue_final_message=False, chat_template_kwargs=None)

