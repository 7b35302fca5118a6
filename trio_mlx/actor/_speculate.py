"""Speculative decoding's rules with no MLX in them: prompt-lookup drafts, the acceptance
rule, and when a row speculates.

A speculative step feeds each decoding row that has drafts its pending token and up
to K drafted tokens in one forward (the batch's other rows their pending token), and
keeps for each the longest prefix of its drafts that the target model itself would have
produced, plus the target's own token after it (`_spec_step.py` runs the step,
`_decode.Decoder.verify` samples the target's tokens). Drafts come from the row's
own tokens (`NgramIndex`: "prompt lookup") or from a small draft model (`_draft.py`).

**The acceptance rule.** Both drafters propose one token per position deterministically
(the n-gram's continuation, the draft model's argmax): the draft distribution q is a
point mass at the drafted token t. The standard speculative-sampling rule then accepts t
with probability min(1, p(t)/q(t)) = p(t), and on a rejection samples from the residual
max(p - q, 0), normalized: p with t taken out. Drawing x ~ p and accepting t exactly when
x == t does the same: P(accept) = P(x = t) = p(t), and given x != t, x is distributed as
p restricted to the other tokens, which is that residual; the drawn x is then the
position's token. So the verifier samples every position as a plain step would (greedy
rows take the argmax, sampled ones draw by Gumbel-max over the row's processed
distribution, a seeded row from its own key for that token's index) and keeps drafts
while they equal what it drew (`accepted`): a seeded row's tokens are the same with
speculation on and off, and a greedy row's are the same as without it.

**Prompt lookup's guesses.** Before a row's prompt lookup may draft, it must have
guessed the row's next tokens: at every step, from the tokens the row's KV holds (on the
host; the pending token is still on the device), it guesses the pending token as the
lookup would (the token after the longest earlier occurrence of their last tokens), and
checks the guess once that token is read back, as a plain step reads it anyway
(`RowSpec.watch`). A row whose last `GUESS_WINDOW` guesses hit fewer than `GUESS_HITS`
times takes plain, pipelined steps with no read-back: on random text, where a lookup's
drafts are seldom kept, it never pays a speculative step to find that out, where
judging by speculative steps alone cost every new row its trial steps (on an H200,
four rows on random prompts decoded at 0.64x of no speculation, almost nothing
drafted). A guess that hits says the drafts after it would be kept too: text being
copied. The drafts themselves follow the guess (`_drafting.py`), so the pending token is
never read back before a step; where this guess missed, the step keeps none of them.
After a speculative step the host has the pending token (the step reads its tokens back:
`RowSpec.known`), and the lookup drafts after it: after a step whose drafts the target
cut short, the guess would be the draft it refused, and the next step would keep nothing
(on the file the embedded model rewrites, a third of the speculative steps did that).

**The policy.** Verifying pays only where one forward over K+1 tokens costs little more
than one over a token, and where drafts are accepted: on an H200 a forward over 8 tokens
costs 1.7-1.9x one token's, and a speculative step gives up the pipelining of plain
steps (its drafts depend on the tokens read back). So rows speculate only in a narrow
batch (`_drafting.Drafter.max_rows`: K+1 tokens cost little more than one while a forward
is bound by reading the weights, which a wide batch's no longer is), and each row keeps
a window of its last `WINDOW` speculative steps: when they accepted fewer than
`MIN_ACCEPTED` drafted tokens a step on average, or took longer per token they gave the
row than the plain steps of a batch as wide take (the decoder's measure of those, when it
has one), the row stops speculating for `BACKOFF` tokens,
twice as long at each further stop (at most `MAX_BACKOFF`), then tries again (what a row
writes changes: an agent starts quoting a file). The time is the judge because what a
step costs differs by device: on an H200 a speculative step of the 1B shape that kept
a drafted token now and then cost 2.7x a pipelined plain step (BENCHMARKS.md). And a
speculative step costs every row of its batch, those without drafts too: so each
width's speculative steps are also judged together (`WidthJudge`), by the tokens they
gave the whole batch against plain steps of that width, and a width whose steps did not
pay goes without speculating for a while. Rows in lockstep (no row padded) never speculate
beside each other: what that costs comes after the step, where no judge sees it
(`_spec_step.py`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

# The shortest suffix of a row's tokens prompt lookup guesses and drafts from: one token
# repeats all the time in any text, and what followed it elsewhere seldom follows it again
# (drafts after a single matching token are seldom kept, and each costs a speculative step);
# two repeat where text is copied.
MIN_MATCH = 2
# Prompt lookup's guesses a row is judged by before it speculates (`RowSpec.watch`): of the
# last GUESS_WINDOW tokens' guesses, GUESS_HITS must have hit. A speculative step costs ~2
# plain ones on an H200 and gives its pending token and the kept drafts: with each guess
# hitting with probability h, about 1 + h + h^2 + ... tokens, 2 at h = 1/2.
GUESS_WINDOW = 8
GUESS_HITS = 4
# Prompt lookup's drafts a step for a row at first, and again after a step that did not keep
# all its drafts; after one that kept all, twice the last, up to the tuning's most
# (`RowSpec.next_k`). Copied text runs on for tens to hundreds of tokens, a speculative step
# costs about as much whatever its length where the host bounds it, and a step's drafts
# past a miss are all lost: so start short and grow while the copy holds. Replayed over a
# file the embedded model rewrites, growing from 16 to 32 took as few speculative steps as
# 32 throughout with two thirds of its drafts (BENCHMARKS.md, "The actor's decode step").
START_DRAFT = 16
# Speculative steps in a row's acceptance window; arbitrary, a few steps' evidence.
WINDOW = 8
# Drafted tokens a speculative step must accept on average over the window, or the row stops
# speculating for a while. A judgement from the one measurement there is (a forward over 8
# tokens at 1.7-1.9x one token's, on an H200): a step that accepts one drafted token gives
# 2 tokens for well under 2 steps' time; one that accepts none costs more than a plain step.
MIN_ACCEPTED = 1.0
# Tokens a row with low acceptance goes without speculating, doubled at each further stop.
BACKOFF = 32
MAX_BACKOFF = 1024
# A width's speculative steps judged together (`WidthJudge`): few, since each one that does
# not pay costs the whole batch; and the steps a width goes without speculating after a stop.
WIDTH_WINDOW = 4
WIDTH_BACKOFF = 256
MAX_WIDTH_BACKOFF = 4096


class NgramIndex:
    """Prompt-lookup drafting over one sequence of tokens (a row's prompt and output).

    For each length m = 1..n, where each m-gram last occurred with a token after it
    (`extend` keeps it current as tokens arrive, in O(n) per token). `draft(k)` finds the
    longest suffix of the sequence, n tokens at most, that occurred earlier in it and
    proposes the k tokens that followed that occurrence, continuing the copy past the end of
    the sequence (a loop repeats: "a b a b" drafts "a b a b ...")."""

    __slots__ = ("n", "tokens", "_last")

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"an n-gram index needs n >= 1, got {n}")
        self.n = n
        self.tokens: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        toks, last = self.tokens, self._last
        start = len(toks)
        toks.extend(new)
        size = len(toks)
        for m in range(1, self.n + 1):
            # The m-grams that end just before each new index j (j >= m) are followed by toks[j],
            # in order, so the latest occurrence wins; built by `zip` in C (a 128k-token prompt's
            # index in ~0.3 s at n = 8 where a loop over its tokens took ~0.5).
            first = max(m, start)
            if first < size:
                grams = zip(*(toks[first - m + i : size - m + i] for i in range(m)), strict=True)
                last[m - 1].update(zip(grams, range(first, size), strict=True))

    def draft(self, k: int, least: int = 1) -> list[int]:
        """Up to `k` tokens to follow the sequence (none if no suffix of at least `least`
        tokens occurred before)."""
        at = self.match(least) if k > 0 else None
        return [] if at is None else self.copy(at, k)

    def match(self, least: int = 1, after: int | None = None) -> int | None:
        """Where the sequence's copy starts: the index just after the latest earlier
        occurrence of its longest suffix (n tokens at most, `least` at least), or None.
        With `after`, of the sequence followed by that token (the index itself unchanged)."""
        toks = self.tokens
        size = len(toks)
        extra = () if after is None else (after,)
        end = size + len(extra)  # the sequence's length, `after` included
        for m in range(min(self.n, end - 1), max(1, least) - 1, -1):
            suffix = (*toks[end - m :], *extra)
            if extra and tuple(toks[size - m :]) == suffix:
                return size  # its latest occurrence ends the index: followed by `after` itself
            at = self._last[m - 1].get(suffix)
            if at is not None:
                return at
        return None

    def copy(self, at: int, k: int, after: int | None = None) -> list[int]:
        """`k` tokens copied from index `at` on (a `match` of the sequence as it is now, with
        the same `after`), continuing the copy past the sequence's end."""
        toks = self.tokens
        size = len(toks)
        known = size if after is None else size + 1
        out: list[int] = []
        for i in range(k):
            p = at + i
            out.append(toks[p] if p < size else after if p < known else out[p - known])  # type: ignore[arg-type]
        return out


class WidthJudge:
    """Whether a batch of a given width speculates at all (the module's docstring, "The
    policy"): a speculative step costs every row of the batch, not only those it drafts
    for, so each width's last `WIDTH_WINDOW` speculative steps are judged by the tokens
    they gave the whole batch against what plain steps of that width give in the same
    time. Where they gave fewer, no batch of that width speculates for
    `WIDTH_BACKOFF` steps, twice as long at each further stop (at most `MAX_WIDTH_BACKOFF`):
    what a step costs is the device's and the model's, which change less than a row's
    text, so the wait is longer than a row's. A batch of one row is left to the row's own
    judgement (`RowSpec.record`: the same time test, over a longer window, with a row's
    shorter wait): its step costs no other row, and judged here too a chat's first few
    speculative steps, where the text had not settled into a copy yet, stopped it for
    256 steps (on an H200, the repeating workload drafted 32 of its 300 tokens). Counts
    the steps it is asked about."""

    __slots__ = ("steps", "_window", "_resume", "_stops")

    def __init__(self) -> None:
        self.steps = 0
        self._window: dict[int, collections.deque[tuple[float, int]]] = {}
        self._resume: dict[int, int] = {}  # width -> the step from which it may speculate again
        self._stops: dict[int, int] = {}

    def allowed(self, width: int) -> bool:
        """Whether a batch of `width` rows may speculate this step (one step counted)."""
        self.steps += 1
        return self.steps >= self._resume.get(width, 0)

    def record(self, width: int, seconds: float, tokens: int, plain: float | None) -> None:
        """A speculative step of `width` rows gave `tokens` (every row's pending token and
        its kept drafts) in `seconds`; a plain step of that width takes `plain` seconds
        (None: not known yet, nothing judged)."""
        if plain is None or width == 1:
            return
        window = self._window.get(width)
        if window is None:
            window = self._window[width] = collections.deque(maxlen=WIDTH_WINDOW)
        window.append((seconds, tokens))
        if len(window) < WIDTH_WINDOW:
            return
        spent, made = sum(s for s, _ in window), sum(t for _, t in window)
        if spent > plain * made / width:  # plain steps give `width` tokens each
            stops = self._stops.get(width, 0)
            self._resume[width] = self.steps + min(MAX_WIDTH_BACKOFF, WIDTH_BACKOFF << stops)
            self._stops[width] = stops + 1
            window.clear()


def accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many of `drafts` the target keeps: the longest prefix equal, position by position,
    to `targets`, the target's own token at each position (the module's docstring)."""
    n = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        n += 1
    return n


def room(k: int, max_tokens: int, generated: int) -> int:
    """Drafted tokens a step may verify for a row that has `generated` tokens out and a
    pending one: the step reports the pending token and the accepted drafts, so no more
    than `max_tokens` allows after that one."""
    return max(0, min(k, max_tokens - generated - 1))


class RowSpec:
    """One row's speculation: its drafter's state, its acceptance window, and from which of
    its tokens it may speculate again (the module's docstring, "The policy")."""

    __slots__ = ("index", "draft", "window", "seconds", "resume_at", "stops", "drafted", "accepted", "guesses",
                 "guess", "_guess_at", "_copy_from", "_after", "k", "known")

    def __init__(self) -> None:
        self.index: NgramIndex | None = None  # prompt lookup's index of the row's tokens
        self.guesses: collections.deque[bool] = collections.deque(maxlen=GUESS_WINDOW)  # each hit or not
        self.guess: int | None = None  # the outstanding guess (None: the lookup had none) ...
        self._guess_at = -1  # ... at this position of the index (-1: none outstanding) ...
        self._copy_from = 0  # ... the index's `match` it was copied from ...
        self._after: int | None = None  # ... with the pending token after the index, where known
        # (position, token): the row's pending token, which a speculative step reads back (it
        # becomes the row's token at that position); `watch` drafts after it, not after a guess
        self.known: tuple[int, int] | None = None
        self.draft: object = None  # the draft model's state for the row (`_draft.DraftState`)
        self.window: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self.seconds: collections.deque[float] = collections.deque(maxlen=WINDOW)  # each step's wall time
        self.resume_at = 0  # the row's token count from which it may speculate
        self.stops = 0  # times low acceptance stopped it
        self.drafted = 0  # tokens drafted for the row, all told
        self.accepted = 0  # ... and accepted
        self.k = 0  # prompt lookup's drafts for its next speculative step (0: none taken yet)

    def allowed(self, position: int) -> bool:
        """Whether the row, holding `position` tokens, may speculate now."""
        return position >= self.resume_at

    def watch(self, index: NgramIndex, least: int) -> bool:
        """Prompt lookup's guesses (the module's docstring): `index` holds the row's tokens
        as far as they are known on the host. Checks the outstanding guess if its token is
        there now, guesses the next unknown one from a suffix of at least `least` tokens (no
        such suffix: a miss), and says whether enough of the last guesses hit for the row's
        drafts to be worth a speculative step.

        Where the pending token is known (`known`, at the index's end: a speculative step
        read it back), the guess of it is checked against it, and the guess is of the token
        after it, from the suffix that ends with it: the drafts then follow the row's real
        text. Guessed from the index alone, after a step whose drafts the target cut short
        the guess would be the draft the target had just refused, and the next speculative
        step would keep nothing."""
        at, size = self._guess_at, len(index)
        known = self.known_at(size)
        if 0 <= at < size:
            self.guesses.append(self.guess is not None and index.tokens[at] == self.guess)
            at = self._guess_at = -1
        elif at == size and known is not None:
            self.guesses.append(self.guess == known)
            at = self._guess_at = -1
        if at < 0:
            start = index.match(least, known)
            self._guess_at, self._copy_from, self._after = size + (known is not None), start or 0, known
            self.guess = None if start is None else index.copy(start, 1, known)[0]
        return sum(self.guesses) >= GUESS_HITS

    def known_at(self, position: int) -> int | None:
        """The row's pending token where a speculative step left it on the host and the row
        holds `position` tokens (it is the token at that position), else None."""
        known = self.known
        return known[1] if known is not None and known[0] == position else None

    def drafts(self, index: NgramIndex, k: int) -> list[int]:
        """The `k` tokens that follow the row's pending token in the copy the outstanding
        guess came from (none without one): `watch`'s search, not a second one, while
        `index` is as it guessed. The guess is the pending token's, or, where that token
        is known, the first draft (and once the index holds that token too, the pending one's
        again: the copy is the same)."""
        size = len(index)
        if self.guess is None:
            return []
        if self._guess_at == size:
            return index.copy(self._copy_from, k + 1)[1:]
        if self._guess_at == size + 1 and self._after is not None:
            return index.copy(self._copy_from, k, self._after)
        return []

    def next_k(self, start: int, most: int) -> int:
        """Prompt lookup's drafts for the row's next speculative step (`START_DRAFT`): `start`
        at first and after a step that did not keep all its drafts, twice the last after one
        that did, `most` at most."""
        return min(most, self.k or start)

    def record(self, drafted: int, accepted: int, position: int, seconds: float | None = None,
               plain: float | None = None) -> None:
        """A speculative step's outcome, the row holding `position` tokens after it: it took
        `seconds` (None: not timed), and a plain step of a batch as wide takes `plain` seconds
        (None: not known yet), giving each row one token."""
        self.drafted += drafted
        self.accepted += accepted
        self.k = 2 * max(self.k, drafted) if drafted and accepted == drafted else 0
        w, t = self.window, self.seconds
        w.append(accepted)
        if seconds is not None:
            t.append(seconds)
        if len(w) < WINDOW:
            return
        # a speculative step gives its kept drafts and the target's own token
        slower = plain is not None and len(t) == WINDOW and sum(t) > plain * (sum(w) + WINDOW)
        if sum(w) < MIN_ACCEPTED * WINDOW or slower:
            self.resume_at = position + min(MAX_BACKOFF, BACKOFF << self.stops)
            self.stops += 1
            w.clear()
            t.clear()
