"""llguidance pieces that both sides of the actor boundary use; no MLX here.

The engine compiles and checks grammars (`engine/_grammar.py`) and the actor
runs one `llguidance.LLMatcher` per constrained row (`actor/_constrain.py`);
both need the model's tokenizer in llguidance's form, built once per
tokenizer (`grammar_vocab`), and both need `finish`: a short token sequence
that completes whatever the matcher has accepted so far. The engine uses it to
refuse a `max_tokens` too small for any valid answer; the actor uses it to
close a row's grammar before its `max_tokens` runs out, so that even a model
that would ramble forever (a random-weight one does) ends with valid output.

What makes a completion longer is a token that opens something: a string, an
object, an array item, another tool call. `GrammarVocab.calm` marks the tokens
that cannot (no `{ [ , : "` or newline in their bytes, not special), and
`jump` measures how much the tokens that can would lengthen it from here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

# The bytes `finish` tries, in order, when nothing is forced: the ones that
# close a JSON string, object or array or separate its members first, then
# `@` and `.` (they carry an email or a hostname to its end), what a value or
# a number can start or end with, then UTF-8 continuation bytes (a token may
# stop in the middle of a character), then every other byte.
_CLOSERS = b'"}],:'  # always tried first, in this order
_FIRST = _CLOSERS + b'@.0123456789-etrufalsnTZ '
_CLOSE_BRACKETS = b"}]"
_OPENERS = b'{[,:"\n'  # bytes that may open something the completion must then close
_PRIORITY = _FIRST + bytes([0x80, 0x90, 0xA0, 0xB0]) + bytes(
    b for b in range(256) if b not in _FIRST and b not in (0x80, 0x90, 0xA0, 0xB0)
)
# The longest completion `finish` looks for. Arbitrary: a JSON value nested a
# few levels deep with a few required keys closes in well under 100 tokens.
FINISH_LIMIT = 512
# Up to how many special tokens `jumpers` tests one by one (Python ints) rather than as one
# numpy gather. Arbitrary: about where the two cost the same.
_FEW_SPECIALS = 16
_CALM, _RAGGED, _SPECIAL = 1, 2, 4  # `GrammarVocab.kinds`' bits
_REPEATS = 4  # arbitrary: numbers and padded strings need a few repeats, never many
# How many of its first tokens `finish` tries its hint after (a UTF-8 character's
# continuation bytes, an escape's next byte). Arbitrary: each try validates the hint,
# tens of microseconds for a long one.
HINT_STEPS = 4
HINT_DROPS = 1  # ... and with how many of the hint's first tokens dropped (a byte the old walk put in a string)


@dataclass(frozen=True, eq=False)
class GrammarVocab:
    """A tokenizer as llguidance sees it, with what `finish` needs."""

    tokenizer: llguidance.LLTokenizer
    eos: tuple[int, ...]  # the ids a finished grammar allows; every one is a stop token
    closers: tuple[int, ...]  # the single-byte tokens of `_CLOSERS`, in that order
    byte_tokens: tuple[int, ...]  # the other single-byte tokens, in `_PRIORITY` order
    brackets: tuple[int, ...]  # the tokens of "}" and "]"
    openers: tuple[int, ...]  # the single-byte tokens of `_OPENERS`
    specials: np.ndarray  # ids of the special tokens, EOS aside
    calm: np.ndarray  # token bitmask (uint32 words, llguidance's layout): the tokens that open nothing
    # A byte per token (read per token, where a bitmask's word costs numpy's scalar access):
    # `_CALM` where it opens nothing, `_RAGGED` where its bytes end inside a UTF-8 character,
    # `_SPECIAL` for a special token (EOS too: the grammar reads it as itself, not its text).
    kinds: bytes

    @property
    def size(self) -> int:
        return self.tokenizer.vocab_size

    def is_calm(self, token: int) -> bool:
        """Whether `token` opens nothing."""
        return bool(self.kinds[token] & _CALM)

    def is_ragged(self, token: int) -> bool:
        """Whether `token` ends inside a UTF-8 character."""
        return bool(self.kinds[token] & _RAGGED)

    def is_special(self, token: int) -> bool:
        """Whether `token` is a special token (EOS included)."""
        return bool(self.kinds[token] & _SPECIAL)


_vocabs: weakref.WeakKeyDictionary[Any, GrammarVocab] = weakref.WeakKeyDictionary()
_by_key: dict[str, GrammarVocab] = {}
_lock = threading.Lock()


def grammar_vocab(tokenizer: Any, *, key: str | None = None) -> GrammarVocab:
    """The GrammarVocab of an mlx-lm TokenizerWrapper (or a fast HF tokenizer), built
    once per tokenizer object: building one reads the whole vocabulary (~0.5 s for
    a 49k vocabulary). With `key` (the model's path) it is also kept under that
    name, so that an actor in the engine's process finds it (`cached_vocab`)
    without a tokenizer of its own. Raises ValueError for a tokenizer llguidance
    cannot use."""
    with _lock:  # held while building: two threads asking at once build it once
        vocab = _vocabs.get(tokenizer) or (_by_key.get(key) if key is not None else None)
        if vocab is None:
            vocab = _build(tokenizer)
        _vocabs[tokenizer] = vocab
        if key is not None:
            _by_key[key] = vocab
        return vocab


def is_panic(exc: BaseException) -> bool:
    """Whether `exc` is a Rust panic out of llguidance: pyo3 raises it as
    `pyo3_runtime.PanicException`, a BaseException (not an Exception) that no
    module exports, so it is known by its name."""
    return type(exc).__name__ == "PanicException"


def cached_vocab(key: str) -> GrammarVocab | None:
    """The GrammarVocab kept under `key` by `grammar_vocab`, if any."""
    with _lock:
        return _by_key.get(key)


def tokenizer_source(tokenizer: Any) -> tuple[str, list[int]]:
    """What llguidance builds its tokenizer from: the fast tokenizer's JSON (padding and
    truncation off, as `llguidance.hf` makes it) and the EOS ids. A process without
    the HF tokenizer (the grammar checkers, `engine/_grammar_pool.py`) builds the same
    GrammarVocab from it with `vocab_from_source`. Raises ValueError as `grammar_vocab`."""
    import copy

    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper keeps the HF one here
    eos_ids = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:  # llguidance reads only "fast" (Rust tokenizers) tokenizers
        raise ValueError("llguidance cannot read this tokenizer: only fast tokenizers are supported")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), eos_ids


def vocab_from_source(text: str, eos_ids: list[int]) -> GrammarVocab:
    """The GrammarVocab of `tokenizer_source`'s answer."""
    try:
        lltok = llguidance.LLTokenizer(text, eos_token=eos_ids)
    except Exception as exc:
        raise ValueError(f"llguidance cannot read this tokenizer: {exc}") from exc
    return _from_lltokenizer(lltok)


def _build(tokenizer: Any) -> GrammarVocab:
    return vocab_from_source(*tokenizer_source(tokenizer))


def _from_lltokenizer(lltok: llguidance.LLTokenizer) -> GrammarVocab:
    singles: dict[int, int] = {}
    for b in _PRIORITY:
        ids = lltok.tokenize_bytes(bytes([b]))
        if len(ids) == 1:
            singles[b] = ids[0]
    size = lltok.vocab_size
    special = np.array([lltok.is_special_token(i) for i in range(size)], dtype=bool)
    texts = [lltok.decode_bytes([i]) for i in range(size)]
    opens = np.array([any(c in _OPENERS for c in b) for b in texts])
    calm = np.zeros(-(-size // 32) * 32, dtype=bool)
    calm[:size] = ~(special | opens)
    kinds = bytes(_CALM * c | _RAGGED * _ends_inside_a_character(b) | _SPECIAL * sp
                  for c, b, sp in zip(calm[:size].tolist(), texts, special.tolist(), strict=True))
    eos = tuple(lltok.eos_tokens)
    special[list(eos)] = False
    return GrammarVocab(
        tokenizer=lltok,
        eos=eos,
        closers=tuple(singles[b] for b in _CLOSERS if b in singles),
        byte_tokens=tuple(t for b, t in singles.items() if b not in _CLOSERS),
        brackets=tuple(singles[b] for b in _CLOSE_BRACKETS if b in singles),
        openers=tuple(singles[b] for b in _OPENERS if b in singles),
        specials=np.flatnonzero(special),
        calm=np.packbits(calm, bitorder="little").view(np.uint32).reshape(1, -1),
        kinds=kinds,
    )


def _ends_inside_a_character(text: bytes) -> bool:
    """Whether `text` ends with the first bytes of a UTF-8 character and not all of them."""
    for back in range(1, min(4, len(text)) + 1):
        b = text[-back]
        if b & 0xC0 != 0x80:  # not a continuation byte: the character's lead (or ASCII)
            size = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return size > back
    return False


def finish(matcher: llguidance.LLMatcher, vocab: GrammarVocab, limit: int = FINISH_LIMIT,
           errors: list[str] | None = None, hint: Sequence[int] = ()) -> list[int] | None:
    """Tokens that take `matcher` (left as it is) to a state where its grammar may end,
    or None if none were found within `limit` tokens. If the walk put the matcher in
    error (one of llguidance's limits, met on the way), the error is added to `errors`.

    `hint`: a completion from a state a few tokens back (the one the caller measured
    last). After each of the walk's first `HINT_STEPS` tokens, if the hint (or the hint
    less its first `HINT_DROPS` tokens) completes the grammar from where the walk
    stands, the walk stops there: the model left the old completion by a token that
    needs a few more before the rest of it fits again (the first byte of a UTF-8
    character, an escape). The answer, the walk's few tokens and the hint, is a
    completion as any other (validated to the end), found in tens of microseconds where
    the whole walk takes milliseconds; it may be a token longer or shorter than the
    walk's own.

    A greedy walk, not a search for the shortest: forced tokens first, then a closing
    bracket that ends the grammar outright, then the first single-byte token the grammar
    allows in `_PRIORITY` order (with the turn-taking below). For JSON this closes the open
    string, then each open container, adding the required keys the grammar forces. Each
    step costs a few microseconds (llguidance's validate and copy). A byte a token keeps
    the completion in step with whatever tokens the model writes instead (a suffix of it
    still completes, `resumes`); `respelled` gives the same bytes in the tokenizer's
    spelling, as short as a model writes them, for what must fit in a budget.
    """
    m = matcher.deep_copy()
    out: list[int] = []
    closers, rest = vocab.closers, list(vocab.byte_tokens)
    last, repeats = -1, 0
    while not m.is_accepting():
        if len(out) >= limit or m.is_stopped():  # stopped but not accepting: an error state
            return _gave_up(m, errors)
        if hint and 0 < len(out) <= HINT_STEPS:
            for k in reversed(range(min(HINT_DROPS + 1, len(hint)))):  # the shorter first
                if completes(m, vocab, hint[k:]):
                    return [*out, *hint[k:]]
        forced = m.compute_ff_tokens()
        if forced and (n := m.try_consume_tokens(forced)):
            out.extend(forced[:n])
            last, repeats = -1, 0  # a closer after forced text is not one chosen again in a row
            continue
        for t in vocab.brackets:
            if m.validate_tokens([t]):
                probe = m.deep_copy()
                probe.consume_token(t)
                if probe.is_accepting():
                    out.append(t)
                    return out
        # A closer chosen over and over may be text, never closing anything (`}`
        # inside a string): after a few in a row it waits its turn. Other bytes
        # take turns, least recently chosen first, so that a pattern that wants a
        # byte further down the list (the `Z` of a date-time) gets it; the closers
        # keep their place, or a number would grow every digit before its `,`.
        first = closers if repeats < _REPEATS else ()
        for t in (*first, *rest):
            if m.validate_tokens([t]):
                m.consume_token(t)
                out.append(t)
                last, repeats = t, repeats + 1 if t == last else 1
                if t in rest:
                    rest.remove(t)
                    rest.append(t)
                break
        else:
            for t in closers:  # the closer that waited may be all there is
                if m.validate_tokens([t]):
                    m.consume_token(t)
                    out.append(t)
                    last, repeats = t, repeats + 1
                    break
            else:
                return _gave_up(m, errors)
    return out


def respelled(matcher: llguidance.LLMatcher, vocab: GrammarVocab, tokens: list[int]) -> list[int]:
    """`tokens`, a completion from `matcher`'s state, in the tokenizer's own spelling of their
    bytes where that is shorter and completes the grammar too (validated), else as they are.

    `finish` walks a byte a token where nothing is forced: its completion of an array of 60
    empty strings took 4 of SmolLM2's tokens an item (`"`, `"`, `,`, ` `), 240 in all, where
    the tokenizer spells the same bytes in 62 (`["`, `",`, then ` "",` an item). So the least `max_tokens` a
    grammar takes (`engine/_grammar.py`) and a row's forced close (`_constrain.py`) take this
    spelling; the grammar reads bytes, not tokens, so it is valid where the walk's is. Its
    tokens span the walk's, so a model that writes the bytes its own way leaves no suffix
    of it that still completes: the row's bookkeeping follows the walk's."""
    if len(tokens) < 2 or any(vocab.is_special(t) for t in tokens):
        return tokens
    tok = vocab.tokenizer
    spelled = tok.tokenize_bytes(tok.decode_bytes(tokens))
    if len(spelled) < len(tokens) and completes(matcher, vocab, spelled):
        return spelled
    return tokens


def _gave_up(m: llguidance.LLMatcher, errors: list[str] | None) -> list[int] | None:
    """`finish`'s answer where its walk found no completion (None), keeping the matcher's
    error in `errors`, if it is in one."""
    if errors is not None and m.is_error():
        errors.append(m.get_error())
    return None


def completes(matcher: llguidance.LLMatcher, vocab: GrammarVocab, tokens: Sequence[int]) -> bool:
    """Whether `tokens` take `matcher` (left as it is) to a state where its grammar may end.

    Asked as "are `tokens` and then EOS valid here" (`validate_tokens`, which leaves the
    matcher as it is): a grammar allows EOS exactly where it may end. Consuming the
    tokens in a copy and asking `is_accepting` answers the same, but consuming a token
    that closes the grammar costs llguidance a mask's computation (~50-90 us against
    under 1 us to validate, for a JSON string over a 128k vocabulary), and the decode
    step asks this of every constrained row in its endgame, every step."""
    if not tokens:  # a matcher stopped where its grammar ends refuses even EOS
        return matcher.is_accepting()
    if not vocab.eos:
        probe = matcher.deep_copy()
        return probe.consume_tokens(list(tokens)) and probe.is_accepting()
    # EOS after the token that ends a grammar counts as valid, though a matcher stopped
    # there refuses it.
    return matcher.validate_tokens([*tokens, vocab.eos[0]]) == len(tokens) + 1


def resumes(matcher: llguidance.LLMatcher, vocab: GrammarVocab, tail: list[int], reach: int = 8,
            after: int | None = None) -> list[int] | None:
    """The longest suffix of `tail` (a completion measured a few tokens ago) that
    completes the grammar from here, dropping at most `reach` of its first tokens, or
    None. The model writes the completion's own next tokens in other spellings (one
    `",` token for a `"` and a `,`): what is left of the old completion then still
    completes, and `finish`'s walk (milliseconds for a long one) is not needed. With
    `after`, the suffix completes from the state after that token (not consumed)."""
    first = () if after is None else (after,)
    for k in range(1, min(reach, len(tail)) + 1):
        if completes(matcher, vocab, [*first, *tail[k:]]):
            return tail[k:]
    return None


def jump(matcher: llguidance.LLMatcher, vocab: GrammarVocab, tail: list[int], allowed: np.ndarray) -> int:
    """How many tokens longer than `tail` (the completion from here) the completion
    may get after one more token: measured for the single-byte openers and the
    special tokens that `allowed` (the current bitmask, uint32 words) lets
    through (`growth` of each). A longer token that opens several things at once
    (`{"`) may jump further; callers leave room for that."""
    return max((growth(matcher, vocab, tail, t) for t in jumpers(vocab, allowed)), default=0)


def jumpers(vocab: GrammarVocab, allowed: np.ndarray) -> list[int]:
    """The tokens `jump` measures that `allowed` (a bitmask, uint32 words) lets through:
    the single-byte openers, then the special tokens."""
    words = allowed.reshape(-1)
    specials = vocab.specials
    if len(specials) > _FEW_SPECIALS:
        picked = specials[(words[specials >> 5] >> (specials & 31).astype(np.uint32)) & 1 == 1].tolist()
        return [t for t in vocab.openers if int(words[t >> 5]) >> (t & 31) & 1] + picked
    # One gather and Python ints, not a numpy scalar per token: the decode step asks this of
    # every constrained row in its endgame, every step, on the thread that waits for the masks.
    ids, at = _jumper_words(vocab)
    return [t for t, w in zip(ids, words[at].tolist(), strict=True) if w >> (t & 31) & 1]


_JUMPER_WORDS: weakref.WeakKeyDictionary[GrammarVocab, tuple[list[int], np.ndarray]] = weakref.WeakKeyDictionary()


def _jumper_words(vocab: GrammarVocab) -> tuple[list[int], np.ndarray]:
    """The openers and then the special tokens, and the bitmask word of each."""
    found = _JUMPER_WORDS.get(vocab)
    if found is None:
        ids = [*vocab.openers, *vocab.specials.tolist()]
        found = _JUMPER_WORDS[vocab] = (ids, np.array([t >> 5 for t in ids], dtype=np.intp))
    return found


def growth(matcher: llguidance.LLMatcher, vocab: GrammarVocab, tail: list[int], token: int) -> int:
    """How many tokens longer than `tail` (the completion from here) the completion gets
    after `token` (allowed here), 0 when no longer."""
    if tail and token == tail[0]:
        return 0  # the completion's own next token: the rest of it follows
    # Most openers lengthen nothing: text inside a string (a comma, a brace), or the
    # completion's own next token in another spelling: what is left of `tail` still
    # completes after it, found by validating alone. Only the others are consumed (in a
    # copy: consuming a token costs llguidance up to a mask) and walked.
    if completes(matcher, vocab, [token, *tail]) or resumes(matcher, vocab, tail, after=token) is not None:
        return 0
    probe = matcher.deep_copy()
    if not probe.consume_token(token):
        return 0
    after = finish(probe, vocab)
    return 0 if after is None else max(0, len(after) + 1 - len(tail))
