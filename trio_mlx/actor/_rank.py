"""What the actor's place in a distributed group changes, as an object the actor holds.

An `Actor` is one class for every rank: it loads, warms up, applies commands and
steps its batch alike. What differs between a single device, rank 0 of a group
(`_distributed.Leader`) and a follower (`_follower.Follower`) is this object: where
the weights come from, which prompt cache it keeps, what bounds each stage (a group's
watchdog), where each step's commands come from (the engine's link through local
admission; rank 0's decisions, sent a step ahead and replayed; a follower's replay of
rank 0's messages) and what a failed step does. `Rank` is the single device's: every
hook its plain behaviour. The actor calls the hooks; a rank calls back into the actor
for the operations every rank shares (`_apply`, `_step`, `_loop`, `_recover`) and reads
its state (the schedule, the batch, the prompt cache).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import models
from ._protocol import Command, StepReport

if TYPE_CHECKING:
    from ._admission import Admission
    from ._link import ActorLink
    from ._reuse import Reuse

log = logging.getLogger("trio_mlx.actor")


class Rank:
    """A single device: the engine's commands through local admission, nothing bounded by a
    group, a failed step recovered from (`Actor._recover`)."""

    # Whether an idle batch's long prefill is cut by the prefill rate this rank measured
    # (`Actor._long_step`): not in a group, whose ranks must cut every step alike.
    progress_cut = True
    # Whether the prompt cache has a disk tier (in a group every rank holds its own shard of
    # the cache, in lockstep: none).
    disk = True
    # Whether this rank computes the logprobs a row asked for (a follower's tokens are nobody's).
    logprobs = True
    # Whether a step that leaves the batch empty hands its report over before its rows leave
    # (`Actor.settle`), so their last tokens do not wait for it: not in a group, whose ranks
    # change their batches alike, in the step.
    settles_after_handover = True

    actor: Any  # the `_actor.Actor` that holds it (typed loosely: that module imports this one)

    def bind(self, actor: Any, link: ActorLink) -> ActorLink:
        """Called once by the actor it belongs to; returns the link the actor talks through."""
        self.actor = actor
        return link

    @contextlib.contextmanager
    def life(self) -> Iterator[None]:
        """Around the actor's whole `run` (a group joins and greets here, and reports its failure)."""
        yield

    def stage(self, what: str, startup: bool = False) -> contextlib.AbstractContextManager[None]:
        """Around one stage (warming up, a `startup` one; stopping): a group bounds each by its
        watchdog, a startup stage by its longer bound."""
        return contextlib.nullcontext()

    def load_weights(self) -> tuple[Any, dict[str, Any]]:
        """(model, config): the whole model, with its adapters (a group's rank loads its shard)."""
        tuning = self.actor.config.tuning
        return models.load_model(self.actor.config.model_path, tuning.adapter_path, tuning.adapter_map or None)

    def open_cache(self) -> Reuse | None:
        """A group's prompt cache (`_group_cache.py`); None: the actor's own."""
        return None

    def loop(self) -> None:
        """The actor's loop, from ready to Shutdown."""
        self.actor._loop()

    def turn(self, commands: Sequence[Command]) -> StepReport | None:
        """One turn of the loop: apply the commands, run the step; None at Shutdown."""
        actor = self.actor
        failed = actor._apply(commands)
        return None if failed is None else actor._step(failed)

    def busy(self) -> bool:
        """Whether there is work without new commands."""
        return bool(self.actor.schedule.seqs)

    def arrivals(self) -> Admission:
        """The admission that holds the arrivals waiting to enter."""
        return self.actor._admission

    def recover(self, exc: BaseException, failed: list[tuple[int, str]]) -> StepReport:
        """A step raised: a single device fails its rows and serves on (`Actor._recover`). The
        traceback goes to the log once (each request gets the message alone), then goes: its
        frames hold what the step was computing (the batch, its logits), which must be freed
        before `_recover` hands MLX's buffer cache back."""
        # as text: a record holding the traceback itself would keep its frames (a handler may keep records)
        log.error("generation step failed; failing its %d sequences\n%s", len(self.actor.schedule.seqs),
                  "".join(traceback.format_exception(exc)).rstrip())
        exc.__traceback__ = None
        return self.actor._recover(exc, failed)
