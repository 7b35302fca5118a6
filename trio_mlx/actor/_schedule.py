"""The scheduler's rules with no MLX in them: the sequence table, and when a sequence ends,
when an aborted one leaves, when finished rows leave the batch.

The real actor (`_actor.py`) and the fake (`_fake.py`) both keep their sequences in a
`Schedule` and decide through it, so the fake ends, aborts and retires exactly as the real
actor does (`tests/integration/test_schedule.py` runs the same tests against both). What a decision
does to the batch (removing rows, storing KV in the prompt cache) stays with the caller;
when queued arrivals enter is `_admission.Admission`'s, fed by `Schedule.decoding` and
`Schedule.prefilling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._protocol import FinishReason, SamplingParams, Stage, Submit


class Constraint(Protocol):
    """What the finish rule reads of a constrained row's grammar (`_constrain.GrammarProcessor`)."""

    error: str | None  # the processor failed (and forced EOS): the row fails, no other
    forced_finish: bool  # max_tokens cut the text where the grammar could not end; it closed it

    def retire(self) -> None:
        """The sequence ended: the row's mask is cheap from now on (its tokens are nobody's)."""


def finish_reason(token: int, generated: int, stops: frozenset[int], max_tokens: int) -> FinishReason | None:
    """Whether the `generated`-th token `token` ends its sequence: a stop token ends it as
    "stop" (even the last one max_tokens allows), else its max_tokens-th token as "length"."""
    return "stop" if token in stops else "length" if generated >= max_tokens else None


@dataclass
class Seq:
    """One sequence the actor serves, from its insert until it ends or is aborted."""

    rid: int
    uid: int  # its row in the batch (the generator's uid; the fake's own count)
    prompt_len: int
    sampling: SamplingParams
    max_tokens: int
    stops: frozenset[int]
    stage: Stage = "queued"
    generated: int = 0
    grammar: Constraint | None = None  # a constrained row's logits mask
    ahead: bool = False  # its first token went out a step early (`Actor._first_tokens`)
    partition: str | tuple[str, str] = ""  # its prompt cache partition (`Submit.partition`)

    @classmethod
    def of(cls, sub: Submit, uid: int, grammar: Constraint | None = None) -> Seq:
        return cls(sub.rid, uid, len(sub.prompt), sub.sampling, sub.max_tokens, sub.stop_token_ids, grammar=grammar,
                   partition=sub.partition)


class Schedule:
    """The sequences in a batch and the rows that finished but have not left it yet.

    Retirement: a sequence ends when the actor says so (`finish`), and its stream ends at
    once, but its row stays in the batch, generating tokens nobody reads, until the batch
    changes anyway (`leaving`: rows are removed or new ones enter), a sequence waits to
    prefill (it needs the slots), the oldest has waited `retire_steps` steps, or the batch
    runs out of live sequences (`dry`); then they all leave in one removal. Removing rows
    one finishing step at a time costs the host far more than the rows cost the device:
    each removal filters every layer's KV cache with a host synchronization per layer
    (mlx_lm's `BatchKVCache.filter`), so the next step cannot overlap the last, and the
    generator also copies out each finished row's cache, which a server never reads.
    `retire_steps` 0 removes them at the next step.
    """

    def __init__(self, retire_steps: int):
        self.retire_steps = retire_steps
        self.seqs: dict[int, Seq] = {}  # rid -> seq, in insert order
        self.by_uid: dict[int, Seq] = {}
        self.retired: dict[int, int] = {}  # uid -> step it finished in; rows still in the batch
        self.decoding = 0  # sequences of `seqs` in the "decode" stage
        self.steps = 0  # steps run with live sequences (the clock retirement counts in)

    @property
    def prefilling(self) -> bool:
        """Whether a sequence is still queued in the batch or prefilling."""
        return len(self.seqs) > self.decoding

    def enter(self, seq: Seq) -> None:
        self.seqs[seq.rid] = seq
        self.by_uid[seq.uid] = seq

    def started(self, seq: Seq) -> bool:
        """`seq`'s prompt is being processed; True if that began now."""
        if seq.stage != "queued":
            return False
        seq.stage = "prefill"
        return True

    def decodes(self, seq: Seq) -> bool:
        """`seq`'s prompt is done; True if it began decoding now."""
        if seq.stage == "decode":
            return False
        seq.stage = "decode"
        self.decoding += 1
        return True

    def finish(self, seq: Seq, token: int, generator: FinishReason | None = None) -> FinishReason | None:
        """Count `token` as `seq`'s next and say whether it ends the sequence: its stop tokens,
        its max_tokens (`finish_reason`), its grammar (a failed processor: "error"; a text
        the grammar closed at max_tokens: "length"), or `generator`, the generator ending the
        row itself. An ended sequence leaves the table here, and its row is retired unless
        the generator dropped it."""
        seq.generated += 1
        reason = finish_reason(token, seq.generated, seq.stops, seq.max_tokens) or generator
        if (g := seq.grammar) is not None and (g.error or (reason == "stop" and g.forced_finish)):
            reason = "error" if g.error else "length"
        if reason is not None:
            self._forget(seq)
            if generator is None:  # still in the batch
                self.retired[seq.uid] = self.steps
        return reason

    def abort(self, rid: int) -> Seq | None:
        """Take an aborted sequence out of the table (None: not in it); its row is the
        caller's to remove before the next step, so that it makes no more tokens."""
        seq = self.seqs.get(rid)
        if seq is not None:
            self._forget(seq)
        return seq

    def gone(self, uid: int) -> bool:
        """A retired row the generator dropped by itself: it leaves the retired; False if it
        was not one."""
        return self.retired.pop(uid, None) is not None

    def due(self) -> bool:
        """Whether the retired rows should leave though nothing else enters or leaves."""
        if not self.retired:
            return False
        return self.prefilling or self.steps - next(iter(self.retired.values())) >= self.retire_steps

    def leaving(self, changing: bool) -> list[int]:
        """Before a step: the retired rows to remove with it (their uids, now forgotten);
        `changing`: rows leave or enter anyway."""
        if not self.retired or not (changing or self.due()):
            return []
        return self._take_retired()

    def dry(self) -> list[int]:
        """After a step: with no live sequence left, every retired row leaves now (nothing
        is left to overlap the removal with)."""
        return self._take_retired() if self.retired and not self.seqs else []

    def slack(self, prompt_len: int, max_tokens: int, context: int) -> int:
        """Steps past max_tokens the generator may run a row: a backstop, never reached
        while retirement works, kept inside the context window."""
        if not self.retire_steps:
            return 0
        return max(0, min(self.retire_steps + 2, context - prompt_len - max_tokens))

    def clear(self) -> None:
        """Forget every sequence and retired row (a fresh batch); the step count stays."""
        self.seqs.clear()
        self.by_uid.clear()
        self.retired.clear()
        self.decoding = 0

    def _forget(self, seq: Seq) -> None:
        del self.seqs[seq.rid]
        del self.by_uid[seq.uid]
        if seq.stage == "decode":
            self.decoding -= 1
        if seq.grammar is not None:  # its row may decode on, retired, for a few steps
            seq.grammar.retire()

    def _take_retired(self) -> list[int]:
        uids = list(self.retired)
        self.retired.clear()
        return uids
