"""A stand-in for the GPU actor that needs no model and no MLX, for testing the layers above.

`open_engine(model, actor=FakeActor)` runs it where the real actor would run
(one `to_thread` call, the same `ThreadLink`), so the engine's registry,
admission, aborts, stop strings, detokenizing and the whole HTTP layer can be
tested in milliseconds, with outputs known in advance. It keeps the actor's
contract: one exchange per step; a Submit joins at the next step (it reports
the prefill and the first token in that step); an Abort leaves before the
next step; a sequence ends at its max_tokens or at one of its stop tokens.

Its "model" continues a prompt with `FakeActor.continuation(prompt, n)`:
counting up from the prompt's last token, wrapping inside [first, vocab); or,
given `reply`, with the tokens `reply(prompt)` returns (asked once per
request, on the actor's thread), and the counting continuation after them: a
scripted model, for tests of what a client does with a given answer (a tool
call, then text). `step_seconds` paces the steps like a slow GPU. (The engine
still loads the model directory's tokenizer; only the weights are never read.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._link import ActorLink
from ._protocol import (
    Abort,
    ActorConfig,
    ActorInfo,
    FinishReason,
    Shutdown,
    StepReport,
    Submit,
    TokenOut,
)


@dataclass
class _Seq:
    sub: Submit
    generated: int = 0
    script: Sequence[int] = ()


class FakeActor:
    """Serves the engine-actor protocol with a counting "model"; see the module docstring."""

    first = 3  # the lowest token it emits: ids below are special in the project's test tokenizers

    def __init__(self, config: ActorConfig, link: ActorLink, *, vocab_size: int = 512,
                 context_length: int = 2048, step_seconds: float = 0.0,
                 reply: Callable[[tuple[int, ...]], Sequence[int]] | None = None):
        self.config, self._link = config, link
        self.vocab_size, self.context_length, self.step_seconds = vocab_size, context_length, step_seconds
        self.reply = reply
        self.steps = 0

    @classmethod
    def continuation(cls, prompt: tuple[int, ...] | list[int], n: int, vocab_size: int = 512) -> list[int]:
        """The `n` tokens the fake model generates after `prompt`."""
        span = vocab_size - cls.first
        last = prompt[-1] if prompt else cls.first
        return [cls.first + (last - cls.first + k + 1) % span for k in range(n)]

    def run(self) -> None:
        link = self._link
        link.ready(ActorInfo(model_type="fake", context_length=self.context_length, vocab_size=self.vocab_size,
                             thread_id=threading.get_ident(), device="fake", load_seconds=0.0, pid=os.getpid()))
        seqs: dict[int, _Seq] = {}
        report = StepReport()
        while True:
            link.check()
            commands: list[Any] = link.exchange(report)
            if not commands and not seqs:
                commands = link.wait_commands()
            new: list[int] = []
            for cmd in commands:
                match cmd:
                    case Submit():
                        seqs[cmd.rid] = _Seq(cmd, script=self.reply(cmd.prompt) if self.reply else ())
                        new.append(cmd.rid)
                    case Abort(rid=rid):
                        seqs.pop(rid, None)
                    case Shutdown():
                        return
            report = self._step(seqs, new)

    def _step(self, seqs: dict[int, _Seq], new: list[int]) -> StepReport:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        out = []
        for rid, seq in list(seqs.items()):
            sub = seq.sub
            if seq.generated < len(seq.script):
                token = seq.script[seq.generated]
            else:
                token = self.continuation(sub.prompt, seq.generated + 1, self.vocab_size)[-1]
            seq.generated += 1
            reason: FinishReason | None = (
                "stop" if token in sub.stop_token_ids
                else "length" if seq.generated >= sub.max_tokens else None)
            if reason is not None:
                del seqs[rid]
            if sub.sampling.logprobs:  # the fake model is certain of every token
                top = ((token, 0.0),) if sub.sampling.top_logprobs else ()
                out.append(TokenOut(rid, token, reason, 0.0, top))
            else:
                out.append(TokenOut(rid, token, reason))
        return StepReport(tokens=tuple(out), prefilling=tuple(new), decoding=tuple(new),
                          prompt_tokens=sum(len(seqs[r].sub.prompt) for r in new if r in seqs),
                          live=len(seqs))
