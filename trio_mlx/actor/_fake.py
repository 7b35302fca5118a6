"""A stand-in for the GPU actor that needs no model and no MLX, for testing the layers above.

`open_engine(model, actor=FakeActor)` runs it where the real actor would run
(one `to_thread` call, the same `ThreadLink`), so the engine's registry,
admission, aborts, stop strings, detokenizing and the whole HTTP layer can be
tested in milliseconds, with outputs known in advance. It keeps the actor's
contract: one exchange per step; a Submit joins at the next step (it reports
the prefill and the first token in that step); an Abort leaves before the
next step. Its sequence table and the decisions when a sequence ends (its
max_tokens, one of its stop tokens), when an aborted one leaves and when a
finished row is retired are the real actor's own (`_schedule.Schedule`).

Its "model" continues a prompt with `FakeActor.continuation(prompt, n)`:
counting up from the prompt's last token, wrapping inside [first, vocab); or,
given `reply`, with the tokens `reply(prompt)` returns (asked once per
request, on the actor's thread), and the counting continuation after them: a
scripted model, for tests of what a client does with a given answer (a tool
call, then text). `step_seconds` paces the steps like a slow GPU. With
`tokens_per_step` above 1, every decoding sequence gets that many tokens a step, as a
speculative step gives a lone row its kept drafts: each through the finish rule in
order, those after the one that ends it dropped, the ones past the first reported as
drafted and kept (`StepReport.speculated`). (The engine still loads the model
directory's tokenizer; only the weights are never read.)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._link import ActorLink
from ._protocol import Abort, ActorConfig, ActorInfo, Shutdown, StepReport, Submit, TokenOut
from ._schedule import Schedule, Seq


class FakeActor:
    """Serves the engine-actor protocol with a counting "model"; see the module docstring."""

    first = 3  # the lowest token it emits: ids below are special in the project's test tokenizers

    def __init__(self, config: ActorConfig, link: ActorLink, *, vocab_size: int = 512,
                 context_length: int = 2048, step_seconds: float = 0.0,
                 reply: Callable[[tuple[int, ...]], Sequence[int]] | None = None,
                 prefill_seconds: float = 0.0, prefill_chunk: int = 0, tokens_per_step: int = 1,
                 load_seconds: float = 0.0):
        self.config, self._link = config, link
        self.vocab_size, self.context_length, self.step_seconds = vocab_size, context_length, step_seconds
        self.prefill_seconds, self.prefill_chunk = prefill_seconds, prefill_chunk
        self.tokens_per_step = tokens_per_step
        self.load_seconds = load_seconds  # `start` sleeps this long, as a model loading
        self.stopped = False  # `stop` was called (by a host)
        self._left: dict[int, int] = {}  # rid -> prompt tokens still to prefill
        self.reply = reply
        self.steps = 0
        # The real actor's table and rules (`_schedule.py`): it ends, aborts and retires alike.
        self.schedule = Schedule(config.tuning.retire_steps)
        self._texts: dict[int, tuple[tuple[int, ...], Sequence[int]]] = {}  # rid -> (prompt, script)
        self._uids = itertools.count()

    @classmethod
    def continuation(cls, prompt: tuple[int, ...] | list[int], n: int, vocab_size: int = 512) -> list[int]:
        """The `n` tokens the fake model generates after `prompt`."""
        span = vocab_size - cls.first
        last = prompt[-1] if prompt else cls.first
        return [cls.first + (last - cls.first + k + 1) % span for k in range(n)]

    def run(self) -> None:
        link, schedule = self._link, self.schedule
        self.start()
        report = StepReport()
        while True:
            link.check()
            commands: list[Any] = link.exchange(report)
            if not commands and not schedule.seqs:
                commands = link.wait_commands()
            turn = self.turn(commands)
            if turn is None:
                return
            report = turn

    # -- what a host of several actors calls (`_host.ActorHost`), as the real actor's -------

    def start(self) -> None:
        if self.load_seconds:
            time.sleep(self.load_seconds)
        self._link.ready(ActorInfo(model_type="fake", context_length=self.context_length,
                                   vocab_size=self.vocab_size, thread_id=threading.get_ident(), device="fake",
                                   load_seconds=self.load_seconds, pid=os.getpid()))

    def due(self, now: float) -> float | None:
        return 0.0 if self.schedule.seqs else None

    def stop(self, clean: bool) -> None:
        self.stopped = True

    def settle(self, link: Any = None) -> StepReport | None:
        """What a dry step left for after its report (`Actor.settle`): a fake has no KV to copy."""
        return None

    def turn(self, commands: Sequence[Any]) -> StepReport | None:
        """Apply the commands and run one step; None at Shutdown."""
        schedule = self.schedule
        arrived: dict[int, Submit] = {}  # every arrival enters at once: no admission window
        removed = False
        for cmd in commands:
            match cmd:
                case Submit():
                    arrived[cmd.rid] = cmd
                case Abort(rid=rid):
                    if arrived.pop(rid, None) is None and schedule.abort(rid) is not None:
                        self._texts.pop(rid, None)
                        self._left.pop(rid, None)
                        removed = True
                case Shutdown():
                    return None
        schedule.leaving(removed or bool(arrived))  # retired rows leave; a fake row holds nothing
        for sub in arrived.values():
            schedule.enter(Seq.of(sub, next(self._uids)))
            self._texts[sub.rid] = (sub.prompt, self.reply(sub.prompt) if self.reply else ())
            self._left[sub.rid] = len(sub.prompt)
        return self._step(list(arrived))

    def _step(self, new: list[int]) -> StepReport:
        """One step: a chunk of each prompt still prefilling (a sequence whose prompt ends in
        it decodes its first token in it), a token for every other."""
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        schedule = self.schedule
        out = []
        speculated = []
        prefilled = 0
        prefilling, decoding = list(new), []
        for seq in list(schedule.seqs.values()):
            left = self._left.get(seq.rid, 0)
            if left:
                take = min(left, self.prefill_chunk or left)
                prefilled += take
                self._left[seq.rid] = left = left - take
                schedule.started(seq)
                if left:
                    continue  # still prefilling: no token yet
                del self._left[seq.rid]
                decoding.append(seq.rid)
            schedule.decodes(seq)
            prompt, script = self._texts[seq.rid]
            made = 0
            while made < self.tokens_per_step:
                made += 1
                if seq.generated < len(script):
                    token = script[seq.generated]
                else:
                    token = self.continuation(prompt, seq.generated + 1, self.vocab_size)[-1]
                reason = schedule.finish(seq, token)
                if reason is not None:
                    del self._texts[seq.rid]
                if seq.sampling.logprobs:  # the fake model is certain of every token
                    top = ((token, 0.0),) if seq.sampling.top_logprobs else ()
                    out.append(TokenOut(seq.rid, token, reason, 0.0, top))
                else:
                    out.append(TokenOut(seq.rid, token, reason))
                if reason is not None:
                    break
            if self.tokens_per_step > 1:
                speculated.append((seq.rid, self.tokens_per_step - 1, made - 1))
        if self.prefill_seconds and prefilled:
            time.sleep(self.prefill_seconds * prefilled)
        if out:
            schedule.steps += 1
        schedule.dry()
        return StepReport(tokens=tuple(out), prefilling=tuple(prefilling), decoding=tuple(decoding),
                          prompt_tokens=prefilled, live=len(schedule.seqs), speculated=tuple(speculated))
