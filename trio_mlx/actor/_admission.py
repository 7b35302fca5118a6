"""Admission policy: when queued sequences enter the decoding batch. Pure Python, no MLX."""

from __future__ import annotations

import collections
import itertools

from ._protocol import Submit

# The most prompts a group of short ones takes: 32 served the most of the sizes measured
# (8, 16, 32; the class's docstring), and never more than half of max_batch, so that as many
# decode beside it. Such a group holds at most half the tokens of a full group of long
# prompts (prefill_batch x prefill_step), so it never needs more memory than the groups a
# server makes anyway. Both are judgement calls around that measurement.
SHORT_GROUP_ROWS = 32


def group_bounds(prefill_batch: int, prefill_step: int, max_batch: int) -> tuple[int, int]:
    """`Admission`'s `rows` and `tokens` for a server's settings: the most prompts a group
    of short ones takes, and the most tokens they hold."""
    return max(prefill_batch, min(SHORT_GROUP_ROWS, max_batch // 2)), prefill_batch * prefill_step // 2


class Admission:
    """When new sequences enter a decoding batch: together, within a bounded window.

    Every change to the batch's membership costs the GPU host work well beyond
    its size: with a 1B model decoding 56 sequences on a GPU, admitting k
    prompts cost two or three decode steps' time on each of the next two steps,
    whether k was 1 or 8. Requests that arrive one step apart (HTTP clients never arrive
    together) would each pay that. So while sequences are decoding, a new one
    waits until `prefill_batch` have gathered or the oldest has waited out
    the window, and then they enter together (as TGI's router waits for
    `max_waiting_tokens`). An idle batch admits a group at once: no decode
    step is disturbed, so waiting would only add latency.

    The wait is `window` once `prefill_batch` sequences decode and shrinks in
    proportion below that: a change slows every decoding sequence by a step
    or two, so with few of them it costs few tokens, while the wait costs
    every waiting request its whole length in time to first token. Measured
    on an H100 with the 1B model under Poisson arrivals at 2 requests/s (1-2
    decoding), the full 20 ms window put the median TTFT at 62 ms against 20
    ms for an arrival into an idle batch.

    One group of at most `prefill_batch` enters at a time, and only once the
    previous group has finished its prefill. The BatchGenerator tops its
    prompt batch up to `prefill_batch` each step, so a group of 7 arriving
    while 1 prompt is mid-prefill locks it into alternating steps of 7 and 1
    prompts, each paying a prefill and a batch change at once (several times
    a whole group's single step, in a step trace). Before the window runs out, only a full group
    enters; the rest wait for more company or the window.

    Sequences that have just finished count as company on its way: a client
    in a loop sends its next request when its stream ends, so a wave that
    finishes together comes back together, a round trip later. Admitted at
    once into the emptied batch, the first to return would enter alone and
    the rest, arriving during its prefill, as a second group: two prefills
    and two batch changes a wave instead of one. So while fewer have arrived than
    finished within the last window, arrivals wait up to window x finished /
    prefill_batch; each admitted arrival takes one finish off the count. A
    lone client (one finished, one back) never waits.

    Short prompts make larger groups. A prefill step's cost hardly depends on
    its group's size, so under many short prompts at once groups of 32 serve
    more tokens than groups of 8, with either actor (BENCHMARKS.md, "Admission
    groups at high concurrency"). But a group of 32 long
    prompts would take 32 x prefill_step tokens through the model in one step.
    So while at least `rows` sequences decode (the load that measurement
    was made under, where a batch change costs the most tokens), and into an
    idle batch (where no decoding row waits on the group's prefill), a group
    whose first `batch` prompts hold at most `tokens` tokens together is full
    only at `rows` prompts, or at the first that would take it past `tokens`;
    any other group is full at `batch`, as it always was. The window, and its
    shrinking below `batch` decoding sequences, stay as they are. Into an idle
    batch that is a wave of returning clients (64 users of equal answers end
    together): on an H200 (1B) a step prefilling 8 prompts of 128 tokens took
    23-27 ms, one of 27-32 such prompts 44-66 ms, so the wave entered in eight
    groups of 8 where two of 32 take less than half as long. Where a prefill's
    cost grows with its tokens instead (a large model on a CPU, or on Apple
    silicon), a larger group saves no time, and its first arrivals wait for the
    whole group's prefill: the trade the loaded batch's rule makes too, with its
    step bounded by `tokens` all the same.

    A group is also full once it fills the batch: beside `decoding` sequences a batch of
    `max_batch` rows takes `max_batch - decoding` more, and one that would take only the
    arrivals there are gains no company by waiting (more could not enter with them: the
    generator holds the rest back until rows leave). Four users on a batch of four rows
    showed it: with speculation on, rows that kept different numbers of drafted tokens
    ended at different steps, so each returning request came beside three decoding rows
    and waited three quarters of the window for a group of four that had no room.
    """

    def __init__(self, window: float, batch: int, rows: int = 0, tokens: int = 0, max_batch: int = 0):
        self.window, self.batch = window, batch
        self.rows = max(batch, rows)  # prompts a group of short ones may take
        self.tokens = tokens  # the most prompt tokens a group past `batch` prompts holds
        self.max_batch = max_batch  # the batch's rows, decoding and entering (0: no bound here)
        self.pending: dict[int, tuple[float, Submit]] = {}  # rid -> (arrival, submit), in order
        self._finished: collections.deque[float] = collections.deque()  # when, unmatched by arrivals

    def finished(self, now: float, count: int) -> None:
        """`count` sequences finished (not aborted) at `now`: their clients may be back."""
        if self.window:
            self._finished.extend(itertools.repeat(now, count))

    def add(self, sub: Submit, now: float) -> None:
        self.pending.setdefault(sub.rid, (now, sub))

    def readmit(self, subs: list[Submit], now: float) -> None:
        """Sequences already admitted once that waited (for a prompt prefilled beside them:
        `_prompt_cache.Reuse`) go back first in line, with no window left to wait."""
        if subs:
            self.pending = {**{s.rid: (now - self.window, s) for s in subs}, **self.pending}

    def drop(self, rid: int) -> bool:
        return self.pending.pop(rid, None) is not None

    def due(self, now: float, decoding: int, prefilling: bool) -> list[Submit]:
        """The group to insert now, oldest first: `decoding` sequences are
        decoding, `prefilling` if any is still queued or prefilling."""
        pending = self.pending
        if not pending or prefilling:
            return []
        take, full = self.group(decoding)
        if decoding and not full:
            age = now - next(iter(pending.values()))[0]
            if age < self.window * min(1.0, decoding / self.batch):
                return []  # wait for a full group, or the window
        if not full and self._awaiting(now):
            return []  # wait for the clients of sequences that just finished
        for _ in range(min(take, len(self._finished))):
            self._finished.popleft()
        return [pending.pop(rid)[1] for rid in list(itertools.islice(pending, take))]

    def group(self, decoding: int = 0) -> tuple[int, bool]:
        """How many of the oldest pending sequences enter together beside `decoding` ones, and
        whether they make a full group: `batch` of them, or, while `rows` or more decode, up
        to `rows` short ones, or as many as the batch has room for (the class's docstring)."""
        rows = self.rows if decoding >= self.rows or not decoding else self.batch
        take = tokens = 0
        for _, sub in self.pending.values():
            if take == rows or (take >= self.batch and tokens + len(sub.prompt) > self.tokens):
                return take, True  # the next one would pass a bound
            tokens += len(sub.prompt)
            take += 1
        room = self.max_batch - decoding
        return take, take == rows or (take >= self.batch and tokens > self.tokens) or 0 < room <= take

    def _awaiting(self, now: float) -> float:
        """Seconds the held arrivals (not a full group) may still wait for the clients of
        sequences that finished within the window (0: no such wait)."""
        finished, pending = self._finished, self.pending
        while finished and now - finished[0] > self.window:
            finished.popleft()
        if not pending or len(pending) >= len(finished):
            return 0.0
        oldest = next(iter(pending.values()))[0]
        return max(0.0, oldest + self.window * min(1.0, len(finished) / self.batch) - now)

    def hold(self, now: float) -> float:
        """With nothing in the batch: seconds until `due` may admit without new commands
        (0: now, or nothing held); the actor sleeps that long at most."""
        wait = 0.0 if self.group()[1] else self._awaiting(now)
        return min(wait, self._finished[0] + self.window - now) if wait else 0.0

