"""Constrained decoding inside the shared batch: one grammar-masking processor per row.

`GrammarProcessor` holds a constrained row's matcher and makes its mask each step.
The actor's decode step drives it in parts (`_decode.py`); it is also an mlx-lm
logits processor, `(tokens, logits) -> logits`, that under mlx-lm's own step
the actor puts last in the row's `logits_processors` when it inserts the row
into the BatchGenerator. The generator calls each row's
processors with that row's logits alone (shape (1, V)) and its token context
(prompt + generated so far), so constrained and free rows share one batch;
a free row pays only what any processor in the batch costs it (mlx-lm then
slices the logits row by row and joins them again).

Each step: feed the token sampled last step to the row's `llguidance.LLMatcher`,
fill the next-token bitmask (numpy, one bit per tokenizer token) and set the
logits of every token it forbids to -inf; tokens past the tokenizer's vocabulary
(logits are often wider) are forbidden too. The actor's own decode step
(`_decode.Decoder`) does the host side for every constrained row of the batch
at once (llguidance's batch consume, `begin`, llguidance's batch fill, `complete`,
which measures the row against its budget where one is due) while the device runs the step's
forward, and applies the masks as one batched op; under mlx-lm's
step (`decode_step="mlx"`) the generator calls the processor per row
(`__call__`), and reading the sampled token from the context waits for the
previous step's sampling in the middle of building the next step.

The processor also keeps its row inside `max_tokens`. Every so often it
measures the completion `_matcher.finish` would write from here; in the
endgame (every step once the tokens left come within reach of it) also how
much one token that opens something could lengthen it (`_matcher.jump`).
Between measurements it counts what each token may have added to the
completion (`_grow`, `_settle`): nothing for the completion's own next token,
a margin's worth for a calm token after which the completion's next token is
still allowed (text inside a string), and the most one token is taken to add
(`_far`) for any other; the next measurement is due only once that count
could bring the row within reach of its endgame (`_due_in`). A measurement the
count shows could only find the row free is not made: the masks are those of
a row that counted every token as the most, measured far more often.
When one such token could leave too little room, the row turns "calm": only
tokens that open nothing, the completion's next token, and EOS where the
grammar may end. When the room is down to the completion, it forces the
completion, then EOS. So the output always parses, even from a model that
would never close its JSON; `forced_finish` tells the actor when text was cut
short to get there (a string ended early, an array with fewer items), or when
no completion fits in `max_tokens` and the text ends unfinished: either way the
row ends "length", never "stop".
A processor never raises: an internal failure forces EOS and is kept in `error`,
because an exception here would fail the whole batch's step.

Speculative decoding (`_spec_step.py`) verifies a row's drafts in one forward, each
position with its own mask: position 0's is the step's own (`begin`, `fill`,
`complete`, with the pending token), and `draft` advances the matcher tentatively
through the drafts for the masks of positions 1..K, stopping at the first draft the
grammar forbids; `keep` then rolls it back past the drafts the step did not keep. Only
a row far from its budget drafts (`draft_room`): free, with no measurement due at the
drafted positions (position 0, the plain step's, may measure), so that their masks are
the matcher's alone; a row in its endgame (calm, forcing, measured every step) drafts
nothing.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from .._cpus import usable_cpus
from ._matcher import (
    GrammarVocab,
    cached_vocab,
    completes,
    finish,
    grammar_vocab,
    is_panic,
    jump,
    respelled,
    resumes,
)

# Tokens of slack kept between the tokens left and the completion: a calm
# token can still lengthen it a little (an escape, half a UTF-8 character,
# the `t` of `true`). Arbitrary; 8 is several times what we saw.
BUDGET_MARGIN = 8
# How much further than the single-byte openers `jump` measures a token
# might push the completion (a `{"` token opens two things). Arbitrary.
JUMP_FACTOR = 2
# The jump assumed before one is measured: it decides when the endgame (a
# measurement every step) begins. Arbitrary; a JSON item with a few required
# keys, or another tool call, jumps 10-40 tokens.
JUMP_GUESS = 32
# How many of the completion's first tokens a token that may open something must leave valid for
# the budget to count it as adding a margin's worth (`_grow`). Arbitrary: a validation of a few
# tokens costs microseconds, the completion's whole tens of them.
_PROBE = 6
_DROPS = 3  # ... or the tokens after its first `_DROPS` at most. Arbitrary: what one token may write of it.


def json_string_grammar() -> str:
    """llguidance's grammar text for any JSON string (the warm-up's constrained row)."""
    return llguidance.LLMatcher.grammar_from_json_schema('{"type": "string"}')


def model_vocab(model_path: os.PathLike[str]) -> GrammarVocab:
    """The model's tokenizer in llguidance's form, for the actor's processors.

    An actor in the engine's process finds the one the engine built while
    compiling the grammar (kept under the model's path); an actor in a child
    process loads the tokenizer and builds its own, once, at its first
    constrained row (about as long as loading the tokenizer takes)."""
    key = str(model_path)
    vocab = cached_vocab(key)
    if vocab is None:
        from .. import models

        vocab = grammar_vocab(models.load_tokenizer(model_path), key=key)
    return vocab


# The completion from a grammar's start, by grammar text: rows that share a grammar (a
# tool set, a response format sent by many clients) start in the same state, and the walk
# that finds it takes milliseconds for a long one (`finish` gives up on a string of at
# least 100,000 characters only after FINISH_LIMIT tokens). Bounded; arbitrary.
_START_TAILS: weakref.WeakKeyDictionary[GrammarVocab, OrderedDict[str, list[int] | None]] = (
    weakref.WeakKeyDictionary())
_START_TAILS_KEPT = 64


def _pool_threads() -> int:
    """llguidance's own default for its pool: 80% of the CPUs this process may use, at least
    one and at most 32."""
    return max(1, min(32, usable_cpus() * 4 // 5))


# The threads of llguidance's pool that fill a batch's masks and feed its tokens (`_decode`).
POOL_THREADS = _pool_threads()
# The most start matchers (lexers) a grammar's rows are dealt across: four per pool thread, at
# most 64. A matcher's `deep_copy` shares its lexer (the automaton llguidance builds lazily as
# rows meet new states) behind one lock that each mask, consume and validation holds
# throughout: rows on one lexer take turns, however many threads fill them (two threads over
# copies of one matcher do the work of one; over matchers built apart, ~1.4x on two cores),
# which is also why the budget checks wait for the batch fill's end (`_decode._fill_many`).
# With one lexer per pool thread a wide batch still put several rows on each, and the pool's
# threads waited on one another (BENCHMARKS.md). Each
# lexer builds its own states, a few MB for a JSON schema's; a grammar has as many as its
# rows alive together needed, up to this, and `_STARTS_TOTAL` bounds those kept idle.
def lexers_for(pool_threads: int) -> int:
    """The most lexers a grammar's rows are dealt across with a pool of `pool_threads`."""
    return min(64, 4 * pool_threads)


LEXERS = lexers_for(POOL_THREADS)


@dataclass
class _Starts:
    """The start matchers of one grammar text, each built apart (a lexer of its own), and
    the rows started from each that are still alive (their processors; a start's load is
    those of them not ended)."""

    matchers: list[llguidance.LLMatcher]
    rows: list[weakref.WeakSet[GrammarProcessor]]


# The matchers at the start of each grammar text, whose copies start the rows that share it (a
# tool set, a response format sent by many clients): building a matcher compiles its grammar,
# milliseconds for an agent's tools (about 10 for fifteen tools), on the actor thread while
# every row waits, where a copy takes microseconds. A new row goes to the start with the fewest
# live rows (not ended: a retired row may stay in the batch); only when every start has some,
# and fewer than LEXERS exist, is another built, so that the pool's threads fill rows of
# one grammar in parallel while a grammar one row at a time uses (one agent's turns) compiles
# once. Bounded, since a grammar's lexers grow as rows use them: the grammars kept, and the
# starts kept over all of them (`_trim_starts`); arbitrary.
_STARTS: weakref.WeakKeyDictionary[GrammarVocab, OrderedDict[str, _Starts]] = weakref.WeakKeyDictionary()
_STARTS_KEPT = 16
_STARTS_TOTAL = 128


def _start_matcher(vocab: GrammarVocab, grammar: str, row: GrammarProcessor) -> tuple[llguidance.LLMatcher, int]:
    """A matcher of `grammar` at its start for `row`, of its own (a copy of a kept one), and
    the index of the start it copies (its lexer, among the grammar's); one in error (the
    grammar does not compile) is not kept. Call on the actor thread."""
    kept = _STARTS.setdefault(vocab, OrderedDict())
    starts = kept.get(grammar)
    if starts is None:
        first = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if first.is_error():
            return first, 0
        kept[grammar] = starts = _Starts([first], [weakref.WeakSet()])
        if len(kept) > _STARTS_KEPT:
            kept.popitem(last=False)
    else:
        kept.move_to_end(grammar)
    loads = [sum(not r.ended for r in rows) for rows in starts.rows[:LEXERS]]
    lexer = min(range(len(loads)), key=loads.__getitem__)
    if loads[lexer] and len(starts.matchers) < LEXERS:
        lexer = len(starts.matchers)
        starts.matchers.append(llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0))
        starts.rows.append(weakref.WeakSet())
        _trim_starts(kept)
    starts.rows[lexer].add(row)
    return starts.matchers[lexer].deep_copy(), lexer


def _trim_starts(kept: OrderedDict[str, _Starts]) -> None:
    """While more than `_STARTS_TOTAL` starts are kept, drop idle ones (no live row on them),
    the least recently used grammar's first and each grammar's last start first; a grammar's
    first start stays (its copies start the next row without a compile), as do the starts of
    the grammar used last. A dropped start's lexer goes once its rows' matchers are gone."""
    total = sum(len(s.matchers) for s in kept.values())
    for starts in list(kept.values())[:-1]:
        while total > _STARTS_TOTAL and len(starts.matchers) > 1 and all(r.ended for r in starts.rows[-1]):
            starts.matchers.pop()
            starts.rows.pop()
            total -= 1


class GrammarProcessor:
    """Masks one row's logits to what its grammar allows; construct it on the actor thread."""

    def __init__(self, vocab: GrammarVocab, grammar: str, max_tokens: int):
        self._vocab = vocab
        self._grammar = grammar
        try:
            self._matcher, self.lexer = _start_matcher(vocab, grammar, self)
        except BaseException as exc:  # a Rust panic is a BaseException: the row fails, not the actor
            if not is_panic(exc):
                raise
            raise ValueError(f"the grammar engine failed on the grammar: {exc}") from None
        if self._matcher.is_error():
            raise ValueError(f"the grammar does not compile: {self._matcher.get_error()}")
        self._bitmask = llnp.allocate_token_bitmask(1, vocab.size)
        self._words = self._bitmask.view(np.uint32)  # bit t%32 of word t//32 is token t
        self._max_tokens = max_tokens
        self._calls = 0
        self._check_at = 0  # the call at which the completion is next measured
        self._tail: list[int] = []  # the completion, as last measured
        self._tail_checked = False  # whether it is known to complete the grammar from here
        self._jump = 0  # the largest jump measured so far
        self._jump_due = False  # this endgame step measures the jump, once the mask is filled
        self._room = 0  # ... and how far the completion may grow before the row must go calm
        self._mode = "free"  # -> "calm" -> "forcing" -> "done" (only EOS)
        self._endgame = False  # the last measurement found the row within reach of its budget's end
        self._spacing = 1  # ... else the calls it set until the next one
        # Between measurements of a free row far from its end: what the tokens since that left
        # the completion (`_tail`, which the ones that follow it shorten) may have added to it
        # (`_grow`); -1 where measurements are not spaced by it.
        self._extra = -1
        self._loose = False  # the completion once came out longer than `_extra` allowed
        self._pending: int | None = None  # a calm token `_extra` took as adding `_far`, until the mask says
        # The tentative drafts `draft` fed the matcher: before each, the completion as it was,
        # whether it was checked, and `_extra` (`keep` puts back what the drafts it undoes changed).
        self._undo: list[tuple[list[int], bool, int]] = []
        self.forced_finish = False
        self.error: str | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's logits processor: `tokens` is the row's context, `logits` its (1, V) row."""
        # The first call sees the prompt alone; every later one, the token
        # sampled from the mask this processor made at the call before.
        if self.begin(int(tokens[-1].item()) if self._calls else None):  # type: ignore[arg-type]
            self.fill()
            self.complete()
        return self._apply(logits)

    # -- one step's host side, in parts, so that a batch fills its masks together ---------
    #
    # `begin(token)` feeds the matcher the token sampled from this row's last mask (None
    # at the first step); when it returns True the row's mask needs the matcher's own
    # (`fill()`, or llguidance's batch fill into the bitmask `bind` gave it), and then
    # `complete()`. The actor's decode step (`_decode.Decoder`) does that for every
    # constrained row of the batch at once; `__call__` for one. Where `measures()`, the
    # step also measures the row against its budget, in `complete()`. A failure in any
    # part ends the row (EOS) and is kept in `error`: it never raises.

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def new_bitmask(self, rows: int) -> np.ndarray:
        """A zeroed bitmask for `rows` rows of this processor's vocabulary (llguidance's layout)."""
        return llnp.allocate_token_bitmask(rows, self._vocab.size)

    def bind(self, row: np.ndarray) -> None:
        """Write this row's mask into `row` (one row of a batch's bitmask, shape (1, words))
        from now on; every step writes it whole, so nothing carries over."""
        self._bitmask = row
        self._words = row.view(np.uint32)

    def consumes(self, token: int | None) -> bool:
        """Whether `begin(token)` feeds the token to the matcher (a batch may feed it first)."""
        return token is not None and self._mode != "done"

    def begin(self, token: int | None, consumed: bool | None = None) -> bool:
        """`consumed`: the matcher was fed `token` already (llguidance's batch consume, for
        the rows where `consumes(token)`), and this was its answer."""
        try:
            if self._advance(token, consumed):
                return True
        except BaseException as exc:  # a bug (or a Rust panic): end the row rather than fail the batch
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            self._fail(exc)
        self._calls += 1
        return False

    def measures(self) -> bool:
        """Whether this step (`begin` returned True) measures the row against its budget."""
        return self._calls >= self._check_at

    def fill(self) -> None:
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask)

    def complete(self) -> None:
        try:
            self._after_fill()
        except BaseException as exc:
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            self._fail(exc)
        self._calls += 1

    def retire(self) -> None:
        """The row's sequence ended (the actor's finish rule, or an abort), though its row may
        stay in the batch a few steps more (retirement): its tokens are nobody's, so its mask
        is EOS alone from now on, with no matcher work, and its start counts it no more
        (`_start_matcher`). A row whose grammar ended it was done already."""
        self._mode = "done"

    @property
    def ended(self) -> bool:
        """Whether the row's mask is EOS alone for good (ended, retired or failed)."""
        return self._mode == "done"

    def fail(self, exc: BaseException) -> None:
        """End the row (EOS from now on), keeping why; a batch call that fed its matcher
        failed. A `begin` must still follow, as every step."""
        self._fail(exc)

    # -- speculative decoding: the masks of a step's drafted positions ---------------------

    def draft_room(self) -> int:
        """How many drafted tokens a speculative step may verify for this row now (0: none).
        Position i of the step is the row's call `_calls + i`: position 0 is its plain step,
        and each drafted one must stay free of the budget's machinery (no measurement due,
        no endgame, not the row's last token), so that its mask is the matcher's own and a
        rollback undoes it (`draft` stops where a measurement at position 0 moved it)."""
        if self._mode != "free" or self.error is not None or self._endgame:
            return 0
        # a measurement due at position 0 is the plain step's own, and sets when the next is due
        due = self._check_at - self._calls - 1 if self._calls < self._check_at else self._spacing - 1
        return max(0, min(due, self._max_tokens - self._calls - 2))

    def draft(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """After this step's position 0 (`begin`, and `fill`/`complete` where it asked): feed
        `drafts` to the matcher tentatively, writing the mask of position i (after the first
        i drafts) into `out[i]`. Stops before the first draft the grammar forbids, or one at
        which the row would leave `draft_room`'s bounds (the grammar stopping, too); returns
        how many it fed. `keep` must follow, in the same step."""
        self._undo = []
        m = self._matcher
        try:
            for t in drafts:
                if self._mode != "free" or self._calls >= self._check_at or self._max_tokens - self._calls <= 1:
                    break
                if m.try_consume_tokens([t]) != 1:
                    break  # forbidden: the matcher is as it was
                if m.is_stopped():
                    m.rollback(1)  # the plain step would end the row here: left to it
                    break
                self._undo.append((self._tail, self._tail_checked, self._extra))
                if follows := self._spelled(t):
                    self._tail = self._tail[follows:]  # a new list: `_undo` holds the old one
                else:
                    self._tail_checked = False
                    self._grow(t, settled=False)
                llnp.fill_next_token_bitmask(m, out, len(self._undo))
                self._calls += 1
        except BaseException as exc:  # as `begin`: the row ends (EOS), the batch goes on
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            self._undo = []
            self._fail(exc)
            return 0
        return len(self._undo)

    def keep(self, n: int) -> None:
        """The step kept the first `n` of the drafts `draft` fed: the matcher, the call count
        and the completion go back to just after them, as if the rest never came."""
        undo, self._undo = self._undo, []
        extra = len(undo) - n
        if extra <= 0 or self._mode == "done":
            return
        try:
            if not self._matcher.rollback(extra):
                raise RuntimeError(f"the grammar could not roll back {extra} tokens: {self._matcher.get_error()}")
        except BaseException as exc:
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            self._fail(exc)
            return
        self._calls -= extra
        self._tail, self._tail_checked, self._extra = undo[n]

    def _fail(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        self._end()

    # -- host side: the matcher and the bitmask -------------------------------------

    def _advance(self, token: int | None, consumed: bool | None = None) -> bool:
        """Feed the matcher (unless `consumed` says how it took the token already); True when
        the mask needs the matcher's fill, then `_after_fill`."""
        m = self._matcher
        if token is not None and self._mode != "done":
            follows = self._spelled(token)
            if follows:
                del self._tail[:follows]  # the rest still completes the grammar
            else:  # the model went its own way (never while forcing: the mask holds)
                self._tail_checked = False
                if self._mode == "forcing":
                    self._mode, self._check_at = "calm", self._calls
            if not (m.consume_token(token) if consumed is None else consumed):
                self.error = f"the grammar refused token {token}: {m.get_error()}"
                self._end()
                return False
            if not follows:
                self._grow(token)
        left = self._max_tokens - self._calls  # tokens this row may still emit, this one included
        if self._mode == "done" or left <= 1 or m.is_stopped():
            if self._mode != "done" and left <= 1 and not m.is_stopped() and not m.is_accepting():
                self.forced_finish = True  # max_tokens cuts the text where the grammar cannot end
            self._end()
            return False
        if self._mode == "forcing":
            if self._tail:
                self._allow(self._tail[:1])
            else:
                self._end()
            return False
        if self._calls >= self._check_at and self._extra >= 0:
            self._check_at = self._calls + self._due_in()  # the tokens since may have added less
        return True

    def _spelled(self, token: int) -> int:
        """How many of the completion's first tokens `token` spells, byte for byte (0: it
        leaves the completion): its own next token, or one token for several of them (`["`
        for `[` and `"`; the completion is walked a byte a token), after which the rest
        completes the grammar as it did (llguidance reads bytes, not tokens)."""
        tail = self._tail
        if not tail:
            return 0
        if token == tail[0]:
            return 1
        if self._vocab.is_special(token):
            return 0  # the grammar reads it as itself, whatever its text
        decode = self._vocab.tokenizer.decode_bytes
        text, spelled = decode([token]), b""
        if not text:
            return 0
        for i, t in enumerate(tail):
            spelled += decode([t])
            if len(spelled) >= len(text) or not text.startswith(spelled):
                return i + 1 if spelled == text else 0
        return 0

    def _grow(self, token: int, settled: bool = True) -> None:
        """`_extra` after `token` (just fed), which left the completion: as much as `_far` says,
        or a margin's worth for a calm one (it opens nothing), which the step's mask must
        then confirm (`_settle`; `settled`: it will, before the matcher moves on), and for
        one that may open something but leaves the completion's first tokens (or all but
        its first) valid: a comma or a brace inside a string, where it is text, or a
        newline between values."""
        if self._extra < 0:
            return
        if self._loose:
            self._extra += self._far()
        elif self._vocab.is_calm(token):
            if settled:
                self._extra += BUDGET_MARGIN
                self._pending = token
            else:
                self._extra += self._far()
        elif self._vocab.is_special(token):
            self._extra += self._far()  # another tool call, a turn's end: measured as a jump is
        else:
            self._extra += BUDGET_MARGIN if self._leaves_completion() else self._far()

    def _leaves_completion(self) -> bool:
        """Whether the completion's first `_PROBE` tokens, or those after its first few, are
        valid from here (the whole of what is left of it, and then its end, where it is no
        longer: a string or a key just opened takes any closing bracket as text). Where only
        those after its first few are (the token wrote them in its own way: `"` for ` "`,
        `":"` for `""`), the completion drops them, so that it stays in step with the text:
        a measurement then finds what is left of it still completing, without a walk."""
        m, tail = self._matcher, self._tail
        for start in range(_DROPS + 1):
            rest = tail[start:start + _PROBE]
            if start + _PROBE >= len(tail):
                ok = completes(m, self._vocab, tail[start:])
            else:
                ok = m.validate_tokens(rest) == len(rest)
            if ok:
                if start:
                    self._tail = tail[start:]  # a new list: `draft`'s undo may hold the old one
                return True
        return False

    def _settle(self) -> None:
        """With the step's mask filled, the calm token `_grow` took as adding a margin's worth:
        right where the completion's next token is still allowed after it, as text inside a
        string leaves it, where it ends inside a character (the next bytes end it), or where
        the completion's first tokens (or those after its first few) are still valid. One
        that leaves it (a choice among an enum's values, a key that picks one of several
        objects) may lengthen the completion by more: `_far`, and the measurement that this
        step may then need after all runs now (`_after_fill`)."""
        token, self._pending = self._pending, None
        if token is None or self._extra < 0:
            return
        t = self._tail[0] if self._tail else None
        if ((t is not None and int(self._words[0, t >> 5]) >> (t & 31) & 1) or self._vocab.is_ragged(token)
                or self._leaves_completion()):
            return
        self._extra += self._far() - BUDGET_MARGIN
        self._check_at = min(self._check_at, self._calls + self._due_in())

    def _far(self) -> int:
        """The most one token is taken to lengthen the completion by."""
        return JUMP_FACTOR * max(JUMP_GUESS, self._jump) + BUDGET_MARGIN

    def _due_in(self) -> int:
        """How many calls from this one the next measurement may wait (0: this one measures): a
        call whose measurement would find the row free even with the completion as long as it
        may be now needs none, and each call after it may add `_far` to it."""
        far = self._far()
        need = len(self._tail) + self._extra + 1 + BUDGET_MARGIN
        room = self._max_tokens - self._calls - need - far  # `_measure`: free where it is positive
        return 0 if room < 1 else (room - 1) // (far + 1) + 1

    def _after_fill(self) -> None:
        """The rest of a step whose mask the matcher filled: the budget's measurement, calm."""
        if self._pending is not None:
            self._settle()
        if self._calls >= self._check_at:
            self._measure(self._matcher, self._max_tokens - self._calls)
            if self._jump_due:
                self._decide_calm()
            if self._mode == "forcing":
                return self._advance_forced()
        if self._mode == "calm":
            accepting = self._matcher.is_accepting()
            self._words &= self._vocab.calm
            self._add(self._tail[:1])
            if accepting:
                self._add(self._vocab.eos)

    def _advance_forced(self) -> None:
        self.forced_finish = bool(self._tail)
        if self._tail:
            self._allow(self._tail[:1])
        else:  # the grammar may end here, and there is no room to go on: it does
            self._end()

    def _measure(self, m: llguidance.LLMatcher, left: int) -> None:
        """Where the row stands against its budget (`m`: its matcher, its mask filled):
        force the completion now; in the endgame, measure every step and go calm when
        one opening token could leave too little room (`_decide_calm`, once the mask
        says which tokens it allows); far from the end, stay free until a later
        measurement."""
        self._jump_due = False
        self._endgame = True  # until found far from the end
        allowed = len(self._tail) + self._extra if self._extra >= 0 else -1
        self._extra, self._pending = -1, None  # followed only while the row is free and far from its end
        # The last completion, if it still completes the grammar from here, saves a
        # walk (inside a string or a number it does); it is the longer one at worst.
        found: list[int] | None = self._tail
        if not (self._tail_checked or completes(m, self._vocab, self._tail)):
            found = resumes(m, self._vocab, self._tail)  # what is left of it, if any
            if found is None:
                found = self._finish(m)
        if found is None:  # no completion found: generate freely, max_tokens may cut the row
            self._check_at, self._endgame, self._spacing = self._max_tokens, False, self._max_tokens
            return
        tail = found
        self._tail, self._tail_checked = tail, True
        if 0 <= allowed < len(tail):  # `_extra` fell short: from now on every token may add `_far`
            self._loose = True
        need = len(tail) + 1 + BUDGET_MARGIN  # + 1: the EOS
        if left <= need:
            # The close, in the tokenizer's spelling of its bytes: as few tokens as a model
            # writes them, where the walk's (a byte a token, which the bookkeeping follows)
            # may not fit in what is left (`_matcher.respelled`)
            self._mode, self._tail = "forcing", respelled(m, self._vocab, tail)
            return
        # Calm whatever the jump: it is not measured (nor kept in `_jump`, which only
        # says when the endgame starts, and the row is well inside it).
        if left <= need + BUDGET_MARGIN:
            self._mode, self._check_at = "calm", self._calls + 1
            return
        far = self._far()
        if left <= need + far:
            self._room, self._jump_due = left - need - BUDGET_MARGIN, True  # `_decide_calm`
        else:
            self._mode, self._endgame, self._extra = "free", False, 0
            # `draft_room`'s guess at the next spacing (`draft` holds to the real one)
            self._spacing = self._due_in()  # at least 1: the row is free
            self._check_at = self._calls + self._spacing

    def _decide_calm(self) -> None:
        """The endgame's step, with the mask filled: calm when one of the openers or special
        tokens it allows could lengthen the completion past the room left (their `jump`)."""
        self._jump_due = False
        here = jump(self._matcher, self._vocab, self._tail, self._words)
        self._jump = max(self._jump, here)
        calm = self._room <= JUMP_FACTOR * here
        self._mode, self._check_at = ("calm" if calm else "free"), self._calls + 1

    def _finish(self, m: llguidance.LLMatcher) -> list[int] | None:
        """`finish` from `m` (the row's matcher or a copy); at the grammar's start, the one
        kept for its text."""
        if self._calls:
            return finish(m, self._vocab, hint=self._tail)
        kept, key = _START_TAILS.setdefault(self._vocab, OrderedDict()), self._grammar
        if key in kept:
            kept.move_to_end(key)
        else:
            kept[key] = finish(m, self._vocab)
            if len(kept) > _START_TAILS_KEPT:
                kept.popitem(last=False)
        tail = kept[key]
        return None if tail is None else list(tail)  # the row's own: `_advance` pops it

    def _end(self) -> None:
        self._mode = "done"
        self._allow(self._vocab.eos)

    def _allow(self, ids: Sequence[int]) -> None:
        self._bitmask.fill(0)
        self._add(ids)

    def _add(self, ids: Sequence[int]) -> None:
        for t in ids:
            self._words[0, t >> 5] |= np.uint32(1 << (t & 31))

    # -- device side: one masked copy of the row's logits ---------------------------

    def _apply(self, logits: mx.array) -> mx.array:
        width = logits.shape[-1]
        words = mx.array(self._words)  # (1, ceil(V / 32)) uint32: V/8 bytes cross to the device
        bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        allowed = bits.reshape(1, -1) != 0
        if allowed.shape[1] >= width:
            allowed = allowed[:, :width]
        else:  # logits wider than the tokenizer: the extra ids are no tokens at all
            allowed = mx.concatenate(
                [allowed, mx.zeros((1, width - allowed.shape[1]), dtype=mx.bool_)], axis=1
            )
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
