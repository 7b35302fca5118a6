"""The engine: one model's lifecycle, its GPU actor's supervision, and admission.

`open_engine()` starts the GPU actor (one thread for the engine's whole life,
see `actor/_actor.py`, or a child process: `actor/_process.py`) and yields an
`Engine`; an actor that dies while serving is started again within a restart
budget (`_supervise.py`). `engine.generate()` / `engine.chat()` return
`RequestStream`s (`_stream.py`): entering one checks its options once
(`_options.check_options`), tokenizes the prompt in a lane that fits its size
(`_lanes.py`) and submits it to the registry (`_registry.py`), which holds the
requests in flight and exchanges commands and step reports with the actor.

All registry state lives on the trio thread; the actor's link reaches it there
(`deliver()` with each step's report, `drain_commands()` for what the actor is
to apply), never from the actor's thread; no locks.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pathlib
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from .. import _heap as heap
from .._errors import (
    ContextLengthExceededError,
    EngineBrokenError,
    EngineClosedError,
    EngineRestartingError,
    InvalidRequestError,
    ModelLoadError,
)
from ..actor import (
    ActorConfig,
    ActorInfo,
    ActorLink,
    ActorTuning,
    Command,
    Grammar,
    SamplingParams,
    Shutdown,
    StepReport,
)
from ._events import EngineStatistics
from ._lanes import TokenizingLanes
from ._limiters import RunLimiter
from ._options import GenerationOptions, check_options, check_sampling_defaults, usable_defaults
from ._prompt import ChatEncoder, max_token_chars, prompt_chars, text_chars
from ._registry import Registry, Request, Terminal
from ._stream import Prepared, RequestStream
from ._structure import check_structure
from ._supervise import RestartBudget
from ._text import normalize_messages

log = logging.getLogger("trio_mlx.engine")

# One GPU, one actor: every engine in a process shares this limiter (rule 1).
# count_tokens counts a prompt that does not fit, too (a client checks before it sends), up to
# this many contexts' worth; past that it is refused from its length as generation is. Judgement.
_COUNT_CONTEXTS = 4
# The most tokens an answer gets when its request names no max_tokens (0: up to the context's
# end, as OpenAI and vLLM do). A model that never writes its end-of-sequence token, or one
# looping on a question it cannot answer, would otherwise generate until the context is full:
# minutes on a large context, with nobody able to stop a non-streaming request. mlx_lm.server's
# default is 512; 4096 leaves room for a whole file's edit. Judgement.
DEFAULT_MAX_TOKENS = 4096
_TUNING_FIELDS = frozenset(f.name for f in dataclasses.fields(ActorTuning))
# The one thread the GPU actor runs on, for every engine of the run: MLX's state is the actor's.
gpu_limiter = RunLimiter("trio_mlx_gpu_limiter", lambda: 1)




class Engine:
    """One model, one GPU actor, many concurrent requests. Start with `open_engine()`
    or `await nursery.start(engine.run)`."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        tuning: ActorTuning | None = None,
        max_queue: int = 1024,
        cache_dir: os.PathLike[str] | None = None,
        switch_interval: float | None = 0.0001,
        actor: str | Callable[[ActorConfig, ActorLink], Any] | Any = "thread",
        fault_hook: Any = None,
        sampling_defaults: Mapping[str, Any] | None = None,
        restart_limit: int = 3,
        restart_window: float = 300.0,
        restart_backoff: float = 1.0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        **knobs: Any,
    ):
        """`tuning`: the actor's (`ActorTuning`'s defaults when None); any of its fields may
        also be given as a keyword (`max_batch=8`), which wins over the record's."""
        if stray := sorted(set(knobs) - _TUNING_FIELDS):
            raise TypeError(f"Engine() got an unexpected keyword argument {stray[0]!r}")
        tuning = dataclasses.replace(tuning or ActorTuning(), **knobs)  # checks every knob (`ActorTuning`)
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
        if actor not in ("thread", "process") and not callable(actor) and not hasattr(actor, "serve"):
            raise ValueError(f"actor must be 'thread', 'process', an actor factory or a host, not {actor!r}")
        if actor == "process" and fault_hook is not None:
            raise ValueError("fault_hook needs actor='thread'")
        self.actor_mode = actor
        self.model_ref = model
        # mlx_lm's BatchGenerator widens its batch to the prefill batch when that is larger,
        # which would let more than max_batch sequences decode together.
        self.tuning = dataclasses.replace(tuning, prefill_batch=min(tuning.prefill_batch, tuning.max_batch))
        self.max_batch = tuning.max_batch  # read by every submit
        self.max_queue = max_queue
        self._cache_dir = cache_dir
        self._switch_interval = switch_interval
        self._fault_hook = fault_hook
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be an integer >= 0, not {default_max_tokens!r}")
        self.default_max_tokens = default_max_tokens  # 0: up to the context's end

        if sampling_defaults is not None:  # a bad default fails here, not in every request
            check_sampling_defaults(sampling_defaults)
        self._sampling_override = sampling_defaults
        # What a request that leaves a sampling option out gets: the model's
        # generation_config.json (as vLLM does), unless `sampling_defaults` was given.
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})

        self.state = "created"
        self.info: ActorInfo | None = None
        self.model_path: os.PathLike[str] | None = None
        self.tokenizer: Any = None
        self._chat: ChatEncoder | None = None
        self._max_token_chars = 0  # 0: no cheap size bound (engine/_prompt.py)
        self._lanes = TokenizingLanes()
        self._special_ids: frozenset[int] = frozenset()
        self._eos_ids: frozenset[int] = frozenset()
        self._registry = Registry()
        self._port = _Port(self)  # what its streams reach (`_stream.StreamPort`)
        self._actor_error: BaseException | None = None
        # A distributed group's status (`actor/_group.GroupStatus`) when this engine is rank 0
        # of one (`engine/_distributed.py`); None on a single device.
        self.group: Any = None
        self._ready_or_dead = trio.Event()
        self._actor_done = trio.Event()
        self._broken = trio.Event()
        self._stop_restarting = trio.Event()
        self._restarts = RestartBudget(restart_limit, restart_window, restart_backoff)

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, start the actor, report started when warm; return when closed."""
        from .. import models  # imported here: loading MLX is the actor's business

        if self.state != "created":
            raise RuntimeError("an Engine can be run only once")
        self.state = "starting"
        try:
            # Each startup stage logs a line with its duration (the actor logs loading and warm-up).
            t0 = trio.current_time()
            log.info("resolving the model %s", self.model_ref or "(the embedded default)")
            path = await trio.to_thread.run_sync(
                lambda: models.resolve_model(self.model_ref, cache_dir=self._cache_dir)
            )
            self.model_path = path
            if self.tuning.adapter_path:  # a bad directory fails here, before the weights load
                adapter = await trio.to_thread.run_sync(models.check_adapter, self.tuning.adapter_path)
                log.info("LoRA adapter: %s", adapter)
            for name, where in self.tuning.adapter_map.items():  # likewise, each named one
                try:
                    found = await trio.to_thread.run_sync(models.check_adapter, where)
                except ModelLoadError as exc:
                    raise ModelLoadError(f"adapter {name!r}: {exc}") from None
                log.info("LoRA adapter %r: %s", name, found)
            t1 = trio.current_time()
            log.info("resolved to %s in %.2f s; loading the tokenizer", path, t1 - t0)
            self.tokenizer = await trio.to_thread.run_sync(models.load_tokenizer, path)
            tok = self.tokenizer
            self._chat = await trio.to_thread.run_sync(lambda: ChatEncoder(tok).warm())
            # Every request's options are checked through the tools module (`_structure.py`),
            # which imports llguidance: 8-20 ms (thread or process actor) on the event loop for
            # the first request, unless imported here, in a worker thread.
            await trio.to_thread.run_sync(importlib.import_module, f"{__package__}._tools")
            log.info("tokenizer loaded in %.2f s", trio.current_time() - t1)
            if self._sampling_override is None:
                self.sampling_defaults = usable_defaults(models.sampling_defaults(path),
                                                         f"{path}/generation_config.json")
            draft_path = await self._resolve_draft() if self.tuning.draft_model else None
        except BaseException:
            self.state = "closed"
            self._actor_done.set()
            raise
        self._max_token_chars = max_token_chars(self.tokenizer)
        self._special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids or ())
        if self._switch_interval is not None:
            # The actor and the event loop share the GIL (docs/design.md, rule 7).
            sys.setswitchinterval(self._switch_interval)
        self._registry.open_inbox()

        disk = pathlib.Path(self._cache_dir or models.default_cache_dir()) / "prompt-cache"
        config = ActorConfig(model_path=path, tuning=self.tuning, fault_hook=self._fault_hook,
                             prompt_cache_disk=str(disk) if self.tuning.prompt_cache_disk_gb else None,
                             draft_model_path=draft_path)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_actor, config)
            await self._ready_or_dead.wait()
            if self.state == "ready":
                task_status.started(self)
        # Only a failed start gets here before close: raise outside the nursery
        # so the error is not wrapped in an exception group.
        error = self._actor_error
        if self.info is None and error is not None:
            if isinstance(error, ModelLoadError):
                raise error
            raise ModelLoadError(
                f"could not load model {str(self.model_ref or 'default')!r} from {path}: "
                f"{type(error).__name__}: {error}"
            ) from error

    async def _resolve_draft(self) -> pathlib.Path:
        """The draft model's directory (`ActorTuning.draft_model`), resolved as the model's is,
        once its tokenizer is found to be the model's: a draft's tokens must mean the same."""
        from .. import models

        ref = self.tuning.draft_model
        path = await trio.to_thread.run_sync(lambda: models.resolve_model(ref, cache_dir=self._cache_dir))
        draft = await trio.to_thread.run_sync(models.load_tokenizer, path)
        mine = self.tokenizer
        same = await trio.to_thread.run_sync(lambda: draft.get_vocab() == mine.get_vocab())
        if not same:
            raise ModelLoadError(f"the draft model {ref!r} ({path}) has another tokenizer than the model's: "
                                 "speculative decoding needs the same token ids")
        log.info("draft model: %s", path)
        return path

    async def _run_one_actor(self, config: Any) -> None:
        """One actor's life: from starting it until it stops or dies."""
        if self.actor_mode == "process":
            from ..actor import run_actor_process

            await run_actor_process(config, ready=self.ready, deliver=self.deliver,
                                    wait_commands=self.wait_commands)
        elif hasattr(self.actor_mode, "serve"):  # the GPU thread of several models (`actor/_host.py`)
            try:
                await self.actor_mode.serve(config, self)
            finally:
                self.on_command = None
        else:
            from ..actor import Actor, ThreadLink

            factory: Any = Actor if self.actor_mode == "thread" else self.actor_mode
            link = ThreadLink(self)
            actor = factory(config, link)
            try:
                await trio.to_thread.run_sync(actor.run, limiter=gpu_limiter(), abandon_on_cancel=False)
            finally:
                link.release()  # its last report, if it held one for a graph it never built
                self.on_command = None  # that link's actor is gone: a new one brings its own

    async def _run_actor(self, config: Any) -> None:
        """Run the actor; one that dies while serving is started again within the restart
        budget (`engine/_supervise.py`), and past it the engine is broken."""
        try:
            while True:
                try:
                    await self._run_one_actor(config)
                    return  # it stopped: a shutdown
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    self._actor_error = exc
                    if not isinstance(exc, Exception):
                        raise
                    if self.state not in ("ready", "restarting"):
                        if self.state == "draining":
                            log.error("the GPU actor died while draining: %s: %s", type(exc).__name__, exc)
                        return  # a failed first start (run() raises it), or the end of a drain
                # Died while serving: every request in flight ends now (rule 8), then a restart.
                error = self._actor_error
                self._registry.fail_all(Terminal("error", "the GPU actor died"))
                delay = self._restarts.next_delay(trio.current_time())
                if delay is None:
                    log.error("the GPU actor died (%s: %s); %s", type(error).__name__, error,
                              "restarts are off: the engine is broken" if not self._restarts.limit else
                              f"{self._restarts.limit} restarts within {self._restarts.window:g} s already: "
                              "the engine is broken")
                    self.state = "broken"
                    return
                log.warning("the GPU actor died (%s: %s); starting a new one in %.1f s (restart %d)",
                            type(error).__name__, error, delay, self._registry.c.restarts + 1,
                            exc_info=error if self.actor_mode != "process" else None)  # a child: no traceback
                self.state = "restarting"
                self._registry.c.restarts += 1
                registry = self._registry
                registry.live, registry.memory = 0, (0, 0, 0)  # the dead actor's; the new one reports its own
                # Commands for the dead actor (aborts of the requests just failed) go with it.
                registry.open_inbox()
                with trio.move_on_after(delay):
                    await self._stop_restarting.wait()
                if self.state != "restarting":
                    return  # aclose() came meanwhile
        except trio.Cancelled:
            # The engine's own task was cancelled (the server is going down):
            # the actor noticed, freed its state and returned. Not a death.
            self.state = "closed"
            raise
        finally:
            if self.state == "broken":
                self._broken.set()
            elif self.state != "closed":
                self.state = "closed"
            reason = "the engine closed" if self.state == "closed" else "the GPU actor died"
            self._registry.fail_all(Terminal("error" if self.state == "broken" else "abort", reason))
            self._registry.close_inbox()
            self._ready_or_dead.set()
            self._actor_done.set()

    def fail(self, reason: str) -> None:
        """The actor can no longer serve though its thread has not returned (a distributed
        group lost a rank, and the actor waits in a collective that will never end): end
        every request with an error event and refuse new ones, as if the actor had died."""
        if self.state in ("closed", "broken"):
            return
        self._actor_error = RuntimeError(reason)
        self.state = "broken"
        self._registry.fail_all(Terminal("error", reason))
        self._ready_or_dead.set()

    @property
    def restart_budget(self) -> RestartBudget:
        return self._restarts

    @property
    def actor_error(self) -> BaseException | None:
        """Why the last actor died, if one did."""
        return self._actor_error

    async def wait_broken(self) -> None:
        """Return when the engine is broken: its actor died and no restart is left."""
        await self._broken.wait()

    async def aclose(self, *, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `drain_timeout`
        seconds, end the rest with finish_reason "abort", stop the actor."""
        if self.state == "restarting":  # nothing in flight; stop the restart
            self.state = "draining"
            self._stop_restarting.set()
        elif self.state == "ready":
            self.state = "draining"
            if self._registry.requests and drain_timeout > 0:
                with trio.move_on_after(drain_timeout):
                    await self._registry.idle.wait()
            self._registry.fail_all(Terminal("abort", "the server is shutting down"))
            try:
                self._registry.to_actor(Shutdown())
            except trio.ClosedResourceError:
                pass
        await self._actor_done.wait()

    # -- called by the actor, on the trio thread -------------------------------

    def ready(self, info: ActorInfo) -> None:
        if self.state == "starting":
            # Startup is over here too: with the process actor, this process froze nothing
            # yet (with the thread actor, the actor's freeze covered it, and this one is
            # cheap). Not at a restart: what requests hold then is not for good.
            heap.freeze()
        self.info = info
        if self.state in ("starting", "restarting"):  # not "draining": a restart that aclose() met
            if self.state == "restarting":
                log.info("the new GPU actor is ready (pid %s)", info.pid)
            self.state = "ready"
        self._registry.last_progress = trio.current_time()
        self._ready_or_dead.set()

    async def wait_commands(self) -> list[Command]:
        return await self._registry.wait_commands()

    def drain_commands(self) -> list[Command]:
        """The commands queued for the actor, taken out of the inbox (a Shutdown once it is closed)."""
        return self._registry.drain_commands()

    def deliver(self, report: StepReport) -> None:
        """Hand one step's tokens to their requests; update stages and counters."""
        self._registry.deliver(report)

    @property
    def on_command(self) -> Callable[[], None] | None:
        """Called on the trio thread after each command queued for the actor: a thread actor's
        link takes commands as they come (`actor._link.ThreadLink`); None otherwise."""
        return self._registry.on_command  # type: ignore[no-any-return]

    @on_command.setter
    def on_command(self, hook: Callable[[], None] | None) -> None:
        self._registry.on_command = hook

    # -- admission -------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state == "ready":
            return
        if self.state == "broken":
            raise EngineBrokenError(f"the GPU actor died: {self._actor_error!r}")
        if self.state == "restarting":
            raise EngineRestartingError("the GPU actor is being restarted after a failure; retry shortly")
        if self.state in ("created", "starting"):
            raise EngineClosedError("the engine is not ready yet")
        raise EngineClosedError("the engine is shutting down" if self.state == "draining" else "the engine is closed")

    def _submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: frozenset[int],
                grammar: Grammar | None = None, cache_salt: str = "", adapter: str | None = None) -> Request:
        self._check_open()
        return self._registry.submit(prompt, max_tokens, sampling, stops, grammar, max_batch=self.max_batch,
                                     max_queue=self.max_queue, cache_salt=cache_salt, adapter=adapter)

    # -- public API ------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.info.context_length if self.info else 0

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters served side by side (`adapters=`), in their order: a
        request names one in its options' `adapter`."""
        return tuple(self.tuning.adapter_map)

    @property
    def in_flight(self) -> int:
        """The requests submitted and not yet ended (a model with none may be unloaded)."""
        return len(self._registry.requests)

    @property
    def mean_step_seconds(self) -> float:
        return self._registry.mean_step_seconds

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            state=self.state,  # type: ignore[arg-type]
            **self._registry.figures(),
            tokenizer_prefix_hits=self._chat.prefix.hits if self._chat is not None else 0,
            tokenizer_prefix_tokens=self._chat.prefix.reused_tokens if self._chat is not None else 0,
        )

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                 **fields: Any) -> RequestStream:
        """Stream a completion of `prompt` (text, or token ids). `options` is a
        `GenerationOptions`; its fields may also be given by name (`max_tokens=64,
        temperature=0`), over `options` where both are. The chat-only fields (tools,
        tool_choice, parallel_tool_calls, continue_final_message, chat_template_kwargs) are
        refused here. With no `max_tokens` the answer gets at most the engine's
        `default_max_tokens` (and never past the context); with `fit_max_tokens`,
        `max_tokens` is a ceiling (`RequestStream.clamped` says it was cut to the context).
        A sampling option left out (None) takes the model's default (`sampling_defaults`)."""
        return RequestStream(self._port, "text", prompt, _merged(options, fields))

    def chat(self, messages: Sequence[Mapping[str, Any]], options: GenerationOptions | None = None,
             **fields: Any) -> RequestStream:
        """Stream the assistant's reply to `messages` (the model's chat template applies).
        Takes the same options as `generate()` (a `GenerationOptions`, or its fields by
        name), and tool calling in OpenAI's shapes: `tools` (functions, rendered through
        the template's `tools`), `tool_choice` ("auto", "none", "required" or {"type":
        "function", "function": {"name": ...}}; the last two are enforced by constrained
        decoding) and `parallel_tool_calls` (False: at most one call, where enforced). Calls
        come as `ToolCalls` events and the request ends with finish_reason "tool_calls";
        while a call is written, `ToolCallDelta`s stream its name and arguments (JSON call
        formats; docs/engine.md). With `continue_final_message` the last message, the
        assistant's, is continued rather than answered (a prefill, as vLLM's option of that
        name and Anthropic's trailing assistant turn): the reply holds only the
        continuation; it cannot be held to a grammar (response_format, tool_choice
        "required" or named), which would start mid-message."""
        return RequestStream(self._port, "chat", messages, _merged(options, fields))

    def _check_size_bound(self, kind: str, chars: int, want: int, contexts: int = 1) -> None:
        """Refuse a prompt that cannot fit before tokenizing it: a text of B bytes (`chars`,
        UTF-8) is at least B / (the longest token's bytes) tokens. Tokenizing 16 MB costs ~25 s
        of CPU and a gigabyte; this costs nothing."""
        if not chars or not self._max_token_chars or not self.context_length:
            return
        floor = -(-chars // self._max_token_chars)
        if floor + want > self.context_length * contexts:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.context_length} tokens; the prompt "
                f"has {chars} bytes of text, at least {floor} tokens, and {want} more were requested",
                param="messages" if kind == "chat" else "prompt",
                prompt_tokens=floor, context_length=self.context_length,
            )

    def encode_prompt(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Prompt -> token ids (synchronous; may be slow for long prompts)."""
        tok = self.tokenizer
        if kind == "chat":
            messages = normalize_messages(value)
            if (template_kwargs or {}).get("continue_final_message") and (
                    not messages or messages[-1].get("role") != "assistant"):
                raise InvalidRequestError("continue_final_message needs the last message to be the "
                                          "assistant's, to continue", param="messages")
            if any(m.get("tool_calls") for m in messages):
                from ._tools import template_messages  # llguidance loads with it: only when needed

                messages = template_messages(messages)
            if self._chat is None or self._chat.tokenizer is not tok:
                self._chat = ChatEncoder(tok)
            try:  # client text tokenized as text: no forged control tokens (engine/_prompt.py)
                return self._chat.encode(messages, template_kwargs)
            except Exception as exc:
                raise InvalidRequestError(f"the chat template failed: {exc}", param="messages") from exc
        if isinstance(value, str):
            return list(tok.encode(value))
        ids = list(value)
        vocab = self.info.vocab_size if self.info else 0
        # Each id's type and range in C (map, min, max): 2.4x faster than a generator's test of
        # each, and never a bool (its type is not int).
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= (vocab or 2**31)):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return ids

    async def count_chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> int:
        """The prompt tokens `chat()` would submit for these messages and tools, without
        submitting anything (Anthropic's count_tokens). Tokenizes in the lane its size picks."""
        self._check_open()
        options = GenerationOptions(tools=tools, tool_choice=tool_choice if tools is not None else None)
        structure = check_structure(self.tokenizer, options, chat=True)
        kwargs = structure.template_kwargs()
        if continue_final_message:
            kwargs["continue_final_message"] = True
        # The bounds and lanes of generation, over a few contexts: a prompt far past them is
        # refused from its length, a very long one waits in the lane of its own (15.6 MB took
        # 67 s on the lane ordinary prompts share).
        return len(await self._encode("chat", messages, kwargs or None, 0, contexts=_COUNT_CONTEXTS))

    async def _encode(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None,
                      want: int, contexts: int = 1) -> list[int]:
        """The prompt's token ids, after the cheap bound (its text, the tools and everything
        else the template renders, against `contexts` times the context with `want` answer
        tokens beside it), in the lane its size picks (`_lanes.py`)."""
        if kind == "text" and isinstance(value, Sequence) and not isinstance(value, str) and self.context_length \
                and len(value) + want > self.context_length:  # token ids: counted, not checked one by one
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.context_length} tokens; the prompt has "
                f"{len(value)} tokens and {want} more were requested", param="prompt",
                prompt_tokens=len(value), context_length=self.context_length)
        limit = contexts * self.context_length * self._max_token_chars  # past this none fits: stop counting
        size = prompt_chars(kind, value, limit)
        if template_kwargs:  # tools of megabytes are prompt text too
            size += text_chars(template_kwargs, limit and max(1, limit - size))
        self._check_size_bound(kind, size, want, contexts)
        return await self._lanes.encode(self.encode_prompt, kind, value, template_kwargs, size)

    async def _prepare(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None,
                       options: GenerationOptions) -> Prepared:
        """The options checked (once: `check_options`), the prompt tokenized, and the answer's
        limit fitted beside it."""
        self._check_open()
        checked = check_options(options, self.sampling_defaults, self.info.vocab_size if self.info else 0,
                                self.adapters)
        prompt = await self._encode(kind, value, template_kwargs, checked.least_answer)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt" if kind == "text" else "messages")
        room = self.context_length - len(prompt)
        max_tokens, clamped = checked.answer_limit(room, self.default_max_tokens)
        if room < 1 or max_tokens > room:
            asked = (f"{max_tokens} more were requested" if checked.max_tokens is not None
                     else "that leaves no room for an answer")
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.context_length} tokens; the prompt "
                f"has {len(prompt)} tokens and {asked}",
                param="messages" if kind == "chat" else "prompt",
                prompt_tokens=len(prompt), context_length=self.context_length,
            )
        stops = checked.stop_token_ids | (frozenset() if checked.ignore_eos else self._eos_ids)
        return Prepared(prompt, max_tokens, clamped, checked, stops)



class _Port:
    """The engine as its request streams see it (`_stream.StreamPort`): all they reach of it."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine):
        self._engine = engine

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model_path(self) -> os.PathLike[str] | None:
        return self._engine.model_path

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._engine._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        return self._engine._special_ids

    def check_open(self) -> None:
        self._engine._check_open()

    async def prepare(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None,
                      options: GenerationOptions) -> Prepared:
        return await self._engine._prepare(kind, value, template_kwargs, options)

    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: frozenset[int],
               grammar: Grammar | None, cache_salt: str = "", adapter: str | None = None) -> Request:
        return self._engine._submit(prompt, max_tokens, sampling, stops, grammar, cache_salt, adapter)

    def abort(self, req: Request, cause: str) -> None:
        self._engine._registry.abort(req, cause)


def _merged(options: GenerationOptions | None, fields: Mapping[str, Any]) -> GenerationOptions:
    """`options` with `fields` (`GenerationOptions`' names; another name is a TypeError) over it."""
    if options is not None and not isinstance(options, GenerationOptions):
        raise TypeError(f"options must be a GenerationOptions, not {type(options).__name__}")
    base = options if options is not None else GenerationOptions()
    return dataclasses.replace(base, **fields) if fields else base



@asynccontextmanager
async def open_engine(model: str | os.PathLike[str] | None = None, **options: Any) -> AsyncIterator[Engine]:
    """Load `model` (a hub id, a local MLX directory, or None for the embedded default),
    start its GPU actor and yield the ready `Engine`; close it on exit.

    Options: `Engine`'s keywords: tuning (an `ActorTuning`) or any of its fields (max_batch,
    prefill_batch, admit_window, retire_steps, ...), max_queue, cache_dir, switch_interval,
    actor ("thread" or "process"), sampling_defaults (None: the model's generation_config.json),
    restart_limit, restart_window, restart_backoff (a dead actor restarted: `_supervise.py`),
    default_max_tokens."""
    engine = Engine(model, **options)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                yield engine
            finally:
                with trio.CancelScope(shield=True):
                    await engine.aclose()
    except BaseExceptionGroup as group:
        # The nursery is an implementation detail: a lone error (a load
        # failure, or the caller's own exception) comes out as itself.
        if len(group.exceptions) == 1:
            exc = group.exceptions[0]
            raise exc from exc.__cause__
        raise
