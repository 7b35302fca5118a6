"""Tests for structured output: engine/_grammar.py compiles, actor/_constrain.py enforces.

The model is a random-weight tiny llama driven through mlx-lm's BatchGenerator
exactly as the actor drives it (`batch_driver.run_rows`): left alone it writes
garbage and never stops, so every valid answer below is the grammar's doing,
including closing the JSON before max_tokens runs out.
"""

from __future__ import annotations

import json
import pickle
import weakref
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np
import pytest
from batch_driver import Row, run_rows

from trio_mlx import models
from trio_mlx._errors import InvalidRequestError
from trio_mlx.actor import _constrain, _matcher
from trio_mlx.actor._constrain import GrammarProcessor
from trio_mlx.actor._matcher import (
    cached_vocab,
    completes,
    finish,
    grammar_vocab,
    jump,
    respelled,
    resumes,
)
from trio_mlx.engine import _grammar

pytestmark = pytest.mark.timeout(120)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "pet": {"enum": ["cat", "dog", None]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet", "address"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "score": {"type": "number"}, "ok": {"type": "boolean"}},
        "required": ["id", "score", "ok"],
    },
    "minItems": 1,
}
FORMATS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("json_object", {"type": "json_object"}, {"type": "object"}),
    ("person", {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}, PERSON),
    ("items", {"type": "json_schema", "json_schema": {"name": "i", "schema": ITEMS}}, ITEMS),
]
PROMPTS = ["Give me JSON.", "Who are you?", "The quick brown fox", "1969"]


@pytest.fixture(scope="module")
def tiny(tiny_model_fp32: Path) -> tuple[Any, Any]:
    model, _ = models.load_model(tiny_model_fp32)
    return model, models.load_tokenizer(tiny_model_fp32)


def check(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name,response_format,schema", FORMATS, ids=[f[0] for f in FORMATS])
def test_alone_output_always_validates(
    tiny: tuple[Any, Any], name: str, response_format: dict[str, Any], schema: dict[str, Any],
    temperature: float,
) -> None:
    model, tok = tiny
    grammar = _grammar.compile_response_format(tok, response_format)
    assert grammar is not None and grammar.kind == response_format["type"]
    mx.random.seed(1)
    for prompt in PROMPTS:
        for max_tokens in (grammar.min_tokens, grammar.min_tokens + 5, grammar.min_tokens + 60):
            (row,) = run_rows(model, tok, [Row(tok.encode(prompt), max_tokens, grammar.source, temperature)])
            check(row.text(tok), schema)
            assert row.finish_reason == "stop" and row.tokens[-1] in tok.eos_token_ids
            assert len(row.tokens) <= max_tokens
            assert row.processor is not None and row.processor.error is None


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batch_of_16_mixed_with_free_rows(tiny: tuple[Any, Any], temperature: float) -> None:
    """Half the rows constrained (three formats), half free, some joining a batch
    already decoding: every constrained row validates, and a free row's greedy
    tokens are the ones it gets alone."""
    model, tok = tiny
    grammars = [_grammar.compile_response_format(tok, f) for _, f, _ in FORMATS]
    mx.random.seed(2)
    rows, schemas = [], []
    for i in range(16):
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)] + " " * (i % 3))
        if i % 2:
            rows.append(Row(prompt, 40 + i, temperature=temperature, late=i >= 12))
            schemas.append(None)
        else:
            g = grammars[i // 2 % len(grammars)]
            assert g is not None
            rows.append(Row(prompt, g.min_tokens + 4 * i, g.source, temperature, late=i >= 12))
            schemas.append(FORMATS[i // 2 % len(FORMATS)][2])
    run_rows(model, tok, rows)
    free_alone = run_rows(model, tok, [Row(rows[1].prompt, rows[1].max_tokens)])[0]
    for row, schema in zip(rows, schemas, strict=True):
        if schema is None and temperature == 0.0:
            assert row.finish_reason == "length" and len(row.tokens) == row.max_tokens
        elif schema is None:  # sampling, a free row may draw EOS (logit 0 against random ones)
            assert len(row.tokens) == row.max_tokens or row.tokens[-1] in tok.eos_token_ids
        else:
            check(row.text(tok), schema)
            assert row.finish_reason == "stop"
    if temperature == 0.0:  # greedy: sharing the batch changed nothing for a free row
        assert rows[1].tokens == free_alone.tokens


def test_processor_masks_exactly_what_llguidance_allows(tiny: tuple[Any, Any]) -> None:
    """The mask set on the logits is llguidance's bitmask bit for bit, and ids past
    the tokenizer's vocabulary (a wider lm_head) are never allowed."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[1][1])
    assert grammar is not None
    proc = GrammarProcessor(vocab, grammar.source, 1000)
    reference = llguidance.LLMatcher(vocab.tokenizer, grammar.source)
    bitmask = llnp.allocate_token_bitmask(1, vocab.size)
    prefix = tok.encode('{"name": "Bo", "age": 4')
    context = list(tok.encode("hi"))
    width = vocab.size + 40
    for i in range(len(prefix) + 1):
        if i:
            context.append(prefix[i - 1])
            assert reference.consume_token(prefix[i - 1])
        out = proc(mx.array(context), mx.zeros((1, width)))
        allowed = np.flatnonzero(np.isfinite(np.array(out[0])))
        llnp.fill_next_token_bitmask(reference, bitmask)
        expected = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
        assert allowed.tolist() == expected[expected < vocab.size].tolist()
        assert allowed.max() < vocab.size
    assert proc.error is None and not proc.forced_finish


def _consumes_to_the_end(matcher: Any, tokens: list[int]) -> bool:
    """`completes` as it was first written: consume in a copy, then ask."""
    probe = matcher.deep_copy()
    return bool(probe.consume_tokens(tokens)) and probe.is_accepting()


def test_completes_answers_as_consuming_does(tiny: tuple[Any, Any]) -> None:
    """`completes` validates the tokens and then EOS instead of consuming them in a copy:
    at every state of a JSON answer written token by token, for the completion found
    there and for its prefixes and suffixes, both answer alike; `resumes` finds a suffix
    of an older completion only where one completes."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])  # items: an array of objects
    assert grammar is not None
    matcher = llguidance.LLMatcher(vocab.tokenizer, grammar.source)
    answer = tok.encode('[{"id": 12, "score": 0.5, "ok": true}, {"id": 3, "score": 1, "ok": false}]')
    old: list[int] = []
    yes = no = 0
    for t in [None, *answer]:
        if t is not None:
            assert matcher.consume_token(t)
        tail = finish(matcher, vocab)
        assert tail is not None
        for cut in {0, 1, len(tail) // 2, len(tail) - 1}:
            for tokens in (tail[cut:], tail[:cut], old[cut:]):
                got = completes(matcher, vocab, tokens)
                assert got == _consumes_to_the_end(matcher, tokens), (t, tokens)
                yes, no = yes + got, no + (not got)
        found = resumes(matcher, vocab, old)
        if found is not None:
            assert _consumes_to_the_end(matcher, found) and found == old[len(old) - len(found):]
        old = tail
    assert yes and no  # both answers were exercised


def _twenty_strings(tok: Any, vocab: Any) -> Any:
    """A matcher at the start of an array of exactly 20 strings of at most 12 characters."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 20, "maxItems": 20}
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    return llguidance.LLMatcher(vocab.tokenizer, grammar.source)


def test_finish_rejoins_its_hint(tiny: tuple[Any, Any]) -> None:
    """After the first byte of a UTF-8 character inside a string, the last completion no
    longer fits; `finish` with it as a hint walks the continuation bytes and then takes
    the hint, a few tokens of walk instead of the whole. What it finds completes the
    grammar, as the whole walk's answer does; a hint that never fits changes nothing."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    m = _twenty_strings(tok, vocab)
    for t in tok.encode('["ab", "c'):
        assert m.consume_token(t)
    hint = finish(m, vocab)
    assert hint is not None and len(hint) > 40
    (lead,) = vocab.tokenizer.tokenize_bytes(b"\xc3")
    assert m.consume_token(lead) and not completes(m, vocab, hint)
    found = finish(m, vocab, hint=hint)
    walked = finish(m, vocab)
    assert found is not None and walked is not None
    assert completes(m, vocab, found) and completes(m, vocab, walked)
    assert found[len(found) - len(hint) + _matcher.HINT_DROPS:] == hint[_matcher.HINT_DROPS:]
    assert len(found) - len(hint) <= _matcher.HINT_STEPS and abs(len(found) - len(walked)) <= 1
    assert finish(m, vocab, hint=list(reversed(hint))) == walked


def test_finish_closes_each_string_of_an_array_at_once(tiny: tuple[Any, Any]) -> None:
    """The closing quote of each item of an array of strings is chosen at once, item after
    item: the `, "` llguidance forces between them is not the same closer chosen over and
    over (text that closes nothing, `}` inside a string), which waits its turn after a few
    in a row. Counted across the forced text, every fifth item got a byte of padding first,
    and the completion the budget fits in was longer than it needs to be."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    m = _twenty_strings(tok, vocab)
    tail = finish(m, vocab)
    assert tail is not None and completes(m, vocab, tail)
    assert json.loads(tok.decode(tail)) == [""] * 20
    for t in tok.encode('["ab", "c'):  # inside a string: `}` and the like are text there
        assert m.consume_token(t)
    tail = finish(m, vocab)
    assert tail is not None and json.loads(tok.decode(tok.encode('["ab", "c')) + tok.decode(tail)) == [
        "ab", "c", *[""] * 18]


class _EveryStep(GrammarProcessor):
    """The budget's rule with no measurement skipped: in the endgame, the jump at every
    step, calm or not (as before the skips)."""

    def _measure(self, m: Any, left: int) -> None:  # after the fill (begin, fill, complete)
        found: list[int] | None = self._tail
        if not (self._tail_checked or completes(m, self._vocab, self._tail)):
            found = resumes(m, self._vocab, self._tail)
            if found is None:
                found = self._finish(m)
        if found is None:
            self._check_at = self._max_tokens
            return
        self._tail, self._tail_checked = found, True
        need = len(found) + 1 + _constrain.BUDGET_MARGIN
        if left <= need:
            self._mode, self._tail = "forcing", respelled(m, self._vocab, found)  # the close, as the tokenizer spells it
            return
        far = _constrain.JUMP_FACTOR * max(_constrain.JUMP_GUESS, self._jump) + _constrain.BUDGET_MARGIN
        if left <= need + far:
            here = _every_jump(m, self._vocab, found, self._words)
            self._jump = max(self._jump, here)
            calm = left <= need + _constrain.JUMP_FACTOR * here + _constrain.BUDGET_MARGIN
            self._mode, self._check_at = ("calm" if calm else "free"), self._calls + 1
        else:
            self._mode = "free"
            self._check_at = self._calls + max(1, (left - need - far) // (far + 1))


def _every_jump(matcher: Any, vocab: Any, tail: list[int], allowed: np.ndarray) -> int:
    """`jump` measuring every opener the mask allows, the completion's own next one too."""
    words = allowed.reshape(-1)
    worst = 0
    for t in (*vocab.openers, *vocab.specials.tolist()):
        if not (words[t >> 5] >> (t & 31)) & 1:
            continue
        if completes(matcher, vocab, [t, *tail]) or resumes(matcher, vocab, tail, after=t) is not None:
            continue
        probe = matcher.deep_copy()
        if probe.consume_token(t) and (after := finish(probe, vocab)) is not None:
            worst = max(worst, len(after) + 1 - len(tail))
    return worst


def _masks_of(proc: GrammarProcessor, tokens: list[int]) -> np.ndarray:
    """The processor's mask after each of `tokens` (the first before any), one step each."""
    out = []
    for i in range(len(tokens) + 1):
        if proc.begin(tokens[i - 1] if i else None):
            proc.fill()
            proc.complete()
        out.append(proc._words.copy())
    return np.concatenate(out)


ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 20, "maxItems": 20}


def test_a_retired_row_masks_eos_alone_and_leaves_its_matcher(tiny: tuple[Any, Any]) -> None:
    """A row whose sequence ended may decode on a few steps (retirement): from `retire` on, its
    mask is EOS alone, with no consume and no fill, and its start counts it no more."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])
    assert grammar is not None
    proc = GrammarProcessor(vocab, grammar.source, 60)
    tail = finish(llguidance.LLMatcher(vocab.tokenizer, grammar.source, log_level=0), vocab)
    assert tail and len(tail) >= 3
    _masks_of(proc, tail[:2])
    assert not proc.ended
    fed = proc.matcher.deep_copy()
    proc.retire()
    assert proc.ended and not proc.consumes(tail[2])
    assert proc.begin(tail[2]) is False  # no fill asked
    allowed = np.flatnonzero(np.unpackbits(proc._words.view(np.uint8), bitorder="little"))
    assert set(allowed.tolist()) == set(vocab.eos)
    assert proc.matcher.validate_tokens(tail[2:3]) == fed.validate_tokens(tail[2:3]) == 1  # not fed


@pytest.mark.parametrize("schema", [PERSON, ITEMS, ARRAY], ids=["person", "items", "array"])
def test_the_budgets_skips_change_no_mask(tiny: tuple[Any, Any], schema: dict[str, Any]) -> None:
    """The measurements the budget skips (the jump where the row is calm whatever it is,
    the completion's own next token in the jump) could not have changed a mask: rows fed
    random tokens from their masks, from max_tokens where the endgame starts at once to
    where the row forces its completion, get the masks the rule measuring everything
    gets, step by step, and their text parses within max_tokens."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    rng = np.random.default_rng(7)
    modes: set[str] = set()
    for max_tokens in (grammar.min_tokens, grammar.min_tokens + 12, grammar.min_tokens + 40):
        for _ in range(3):
            proc, tokens = GrammarProcessor(vocab, grammar.source, max_tokens), []
            while True:
                if proc.begin(tokens[-1] if tokens else None):
                    proc.fill()
                    proc.complete()
                modes.add(proc._mode)
                allowed = np.flatnonzero(np.unpackbits(proc._words.view(np.uint8), bitorder="little"))
                tokens.append(int(rng.choice(allowed)))
                if tokens[-1] in vocab.eos:
                    break
            assert len(tokens) <= max_tokens and proc.error is None
            check(tok.decode(tokens[:-1]), schema)
            reference = _masks_of(_EveryStep(vocab, grammar.source, max_tokens), tokens[:-1])
            again = _masks_of(GrammarProcessor(vocab, grammar.source, max_tokens), tokens[:-1])
            assert np.array_equal(again, reference)
    assert {"free", "calm", "forcing"} <= modes


ENUMS = {"type": "array", "items": {"enum": ["a", "b" * 30, "cd"]}, "minItems": 3, "maxItems": 9}


def _counted(proc: GrammarProcessor) -> list[int]:
    """A one-item list counting `proc`'s measurements against its budget from now on."""
    count = [0]
    measure = proc._measure

    def counted(*a: Any) -> None:
        count[0] += 1
        measure(*a)

    proc._measure = counted  # type: ignore[method-assign]
    return count


def _random_row(proc: GrammarProcessor, rng: np.random.Generator, vocab: Any) -> tuple[list[int], int]:
    """Feed `proc` random tokens from its masks to EOS: (the tokens, how many steps measured)."""
    count, tokens = _counted(proc), []
    while True:
        if proc.begin(tokens[-1] if tokens else None):
            proc.fill()
            proc.complete()
        allowed = np.flatnonzero(np.unpackbits(proc._words.view(np.uint8), bitorder="little"))
        tokens.append(int(rng.choice(allowed)))
        if tokens[-1] in vocab.eos:
            return tokens, count[0]


@pytest.mark.parametrize("schema", [ARRAY, ENUMS], ids=["array", "enums"])
def test_a_row_far_from_its_end_measures_by_what_its_tokens_may_add(tiny: tuple[Any, Any], schema: dict[str, Any]) -> None:
    """Between measurements, a free row far from its end counts what each token may have added
    to its completion: nothing for the completion's own next token, a margin's worth for a
    calm token after which the completion's next token is still allowed (text in a string),
    the most one token may add for any other (an enum's value picked by a letter, an opener).
    It measures itself far less often than when every token counted as the most, with the
    same masks, and its text parses within max_tokens."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    rng = np.random.default_rng(11)
    ours = theirs = 0
    for max_tokens in (grammar.min_tokens + 150, grammar.min_tokens + 300):
        for _ in range(3):
            proc = GrammarProcessor(vocab, grammar.source, max_tokens)
            tokens, measured = _random_row(proc, rng, vocab)
            assert len(tokens) <= max_tokens and proc.error is None
            check(tok.decode(tokens[:-1]), schema)
            reference = _EveryStep(vocab, grammar.source, max_tokens)
            count = _counted(reference)
            masks = _masks_of(GrammarProcessor(vocab, grammar.source, max_tokens), tokens[:-1])
            assert np.array_equal(masks, _masks_of(reference, tokens[:-1]))
            ours, theirs = ours + measured, theirs + count[0]
    assert ours * 2 < theirs, (ours, theirs)


def test_a_batch_measures_its_rows_after_the_fill(tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's budget measurement validates tokens with its lexer's lock held, and llguidance
    validates with the GIL held: beside the batch fill, which holds each lexer while it fills
    its rows, a measurement waited for that fill with the GIL that the forward's encoding
    needs. The decode step measures its rows after the fill, on the thread that filled."""
    import threading

    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": ARRAY}})
    assert grammar is not None
    events: list[tuple[str, Any]] = []
    fill_par = llnp.fill_next_token_bitmask_par

    def fill(*args: Any) -> None:
        events.append(("fill", threading.current_thread()))
        fill_par(*args)
        events.append(("filled", threading.current_thread()))

    measure = GrammarProcessor._measure

    def measured(self: GrammarProcessor, *args: Any) -> None:
        events.append(("measure", threading.current_thread()))
        measure(self, *args)

    monkeypatch.setattr(llnp, "fill_next_token_bitmask_par", fill)
    monkeypatch.setattr(GrammarProcessor, "_measure", measured)
    rows = [DecodeRow(SamplingParams(temperature=0.0), grammar=GrammarProcessor(vocab, grammar.source, n))
            for n in (grammar.min_tokens + 10, grammar.min_tokens + 20, grammar.min_tokens + 30)]
    decoder, fed, rng = Decoder(), None, np.random.default_rng(5)
    for _ in range(6):
        plan = decoder._plan_for(rows, vocab.size)
        decoder._masks(plan, fed)
        assert plan.bitmask is not None
        fed = [int(rng.choice(np.flatnonzero(np.unpackbits(plan.bitmask[j : j + 1].view(np.uint8), bitorder="little"))))
               for j in range(len(rows))]
    assert sum(e == "measure" for e, _ in events) >= 6 and sum(e == "fill" for e, _ in events) >= 4
    filling = False
    for what, thread in events:
        assert thread is threading.current_thread()
        assert not (filling and what == "measure")
        filling = what == "fill" or (filling and what != "filled")


def test_what_a_token_may_add_depends_on_where_it_falls(tiny: tuple[Any, Any]) -> None:
    """Between measurements a comma inside a string is text (it leaves the completion's first
    tokens valid: a margin's worth), a comma between items opens another one (the most one
    token may add), and the completion's own next token adds nothing."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 1}  # completion from the start: ["" ]
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    proc = GrammarProcessor(vocab, grammar.source, 400)
    added = []
    for t in [None, *tok.encode('["ab,c"'), *tok.encode(",")]:
        before = proc._extra
        if proc.begin(t):
            proc.fill()
            proc.complete()
        added.append((tok.decode([t]) if t is not None else "", proc._extra - before))
    margin, far = _constrain.BUDGET_MARGIN, proc._far()
    assert added[1:] == [("[", 0), ('"', 0), ("a", margin), ("b", margin), (",", margin), ("c", margin), ('"', 0),
                         (",", far)]


def test_the_completion_stays_in_step_with_tokens_that_spell_it_their_own_way(tiny: tuple[Any, Any]) -> None:
    """A token that writes several of the completion's tokens at once (` "` where the
    completion walked ` ` and `"`, a byte a token) follows it, adding nothing; one that takes
    the place of the completion's first (another last character of a string at its
    maxLength) leaves it, a margin's worth added, and the completion drops that first."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": ARRAY}})
    assert grammar is not None
    (space_quote,), (quote,), (space,) = tok.encode(' "'), tok.encode('"'), tok.encode(" ")

    def fed(text: str) -> GrammarProcessor:
        proc = GrammarProcessor(vocab, grammar.source, grammar.min_tokens + 300)
        _masks_of(proc, tok.encode(text))
        return proc

    def step(proc: GrammarProcessor, token: int) -> None:
        assert proc.begin(token)
        proc.fill()
        proc.complete()

    proc = fed('["a",')
    tail, extra = list(proc._tail), proc._extra
    assert tail[0] == space_quote and extra >= 0
    proc._tail = [space, quote, *tail[1:]]  # the same bytes, a byte a token
    assert completes(proc.matcher, vocab, proc._tail)
    step(proc, space_quote)
    assert proc._tail == tail[1:] and proc._extra == extra

    proc = fed('["' + "a" * 11)  # a string one character short of its 12
    (b,), (comma,) = tok.encode("b"), tok.encode(",")
    proc._tail = [b, *proc._tail]  # a completion that writes the twelfth itself
    assert completes(proc.matcher, vocab, proc._tail)
    tail, extra = list(proc._tail), proc._extra
    step(proc, comma)  # the twelfth, text: the completion's `b` no longer fits, its rest does
    assert proc._tail == tail[1:] and proc._extra == extra + _constrain.BUDGET_MARGIN
    assert completes(proc.matcher, vocab, proc._tail)


def test_a_special_token_never_spells_the_completion(tiny: tuple[Any, Any]) -> None:
    """A token follows the completion where its bytes spell the completion's first tokens; a
    special token never does (the grammar reads it as itself, whatever its text)."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])
    assert grammar is not None
    proc = GrammarProcessor(vocab, grammar.source, 200)
    lltok = vocab.tokenizer

    def bytewise(text: bytes) -> list[int]:
        return [lltok.tokenize_bytes(bytes([b]))[0] for b in text]

    (space_quote,) = tok.encode(' "')
    proc._tail = bytewise(b' "x')
    assert proc._spelled(space_quote) == 2
    special = int(vocab.specials[1])
    proc._tail = bytewise(lltok.decode_bytes([special]))
    assert len(proc._tail) > 1 and proc._spelled(special) == 0


def test_a_row_whose_count_fell_short_counts_every_token_as_the_most(tiny: tuple[Any, Any]) -> None:
    """Where a measurement finds the completion longer than the count allowed (a token added
    more than it was taken to), the row stops trusting the count: from then on every token
    that leaves the completion adds the most one token may, as before the count."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": ARRAY}})
    assert grammar is not None
    proc = GrammarProcessor(vocab, grammar.source, grammar.min_tokens + 300)
    _masks_of(proc, tok.encode('["ab'))
    assert not proc._loose and proc._extra >= 0
    proc._tail, proc._tail_checked = proc._tail[:1], False  # a count that fell short of the truth
    proc._measure(proc.matcher, proc._max_tokens - proc._calls)
    assert proc._loose and proc._extra == 0 and len(proc._tail) > 1
    (d,) = tok.encode("d")
    assert proc.begin(d)  # calm, inside the string: a margin's worth, but for a loose row the most
    assert proc._extra == proc._far()


def test_ragged_tokens_are_the_ones_ending_inside_a_character() -> None:
    assert not _matcher._ends_inside_a_character(b"abc")
    assert not _matcher._ends_inside_a_character("é".encode())
    assert _matcher._ends_inside_a_character("é".encode()[:1])
    assert _matcher._ends_inside_a_character(b"x" + "€".encode()[:2])
    assert not _matcher._ends_inside_a_character("€".encode()[1:])  # continuation bytes end one
    assert _matcher._ends_inside_a_character("𝄞".encode()[:3])
    assert not _matcher._ends_inside_a_character(b"")


@pytest.mark.parametrize("lexers", [1, 3], ids=["one-lexer", "three-lexers"])
@pytest.mark.parametrize("schema", [ITEMS, ARRAY], ids=["items", "array"])
def test_a_batch_gets_the_masks_each_row_gets_alone(
        tiny: tuple[Any, Any], schema: dict[str, Any], lexers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's host side for many rows at once (llguidance's batch consume and
    fill, the budget checks) makes each row the masks it makes alone, step by step, rows
    leaving as they end (EOS drawn, or max_tokens reached); with the grammar's rows dealt
    across three starts (a pool of three threads) as with all on one."""
    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    _, tok = tiny
    vocab = grammar_vocab(tok)
    monkeypatch.setattr(_constrain, "LEXERS", lexers)
    _constrain._STARTS.pop(vocab, None)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    rng = np.random.default_rng(3)
    budgets = [grammar.min_tokens + k for k in (0, 3, 9, 20, 40, 80)] * 2
    rows = [DecodeRow(SamplingParams(temperature=0.0), grammar=GrammarProcessor(vocab, grammar.source, n))
            for n in budgets]
    assert {r.grammar.lexer for r in rows} == set(range(lexers))  # type: ignore[union-attr]
    budget = {id(r): n for r, n in zip(rows, budgets, strict=True)}
    tokens: dict[int, list[int]] = {id(r): [] for r in rows}
    masks: dict[int, list[np.ndarray]] = {id(r): [] for r in rows}
    decoder, live, fed = Decoder(), list(rows), None
    while live:
        plan = decoder._plan_for(live, vocab.size)
        decoder._masks(plan, fed)
        assert plan.bitmask is not None
        going = []
        for j, r in enumerate(live):
            words = plan.bitmask[j : j + 1].view(np.uint32)
            masks[id(r)].append(words.copy())
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            tokens[id(r)].append(t := int(rng.choice(allowed)))
            if t not in vocab.eos and len(tokens[id(r)]) < budget[id(r)]:
                going.append(r)
        live, fed = going, [tokens[id(r)][-1] for r in going]
    for r, n in zip(rows, budgets, strict=True):
        got = tokens[id(r)]
        assert len(got) <= n and got[-1] in vocab.eos and r.grammar.error is None  # type: ignore[union-attr]
        check(tok.decode(got[:-1]), schema)
        assert np.array_equal(np.concatenate(masks[id(r)]), _masks_of(GrammarProcessor(vocab, grammar.source, n), got[:-1]))


def test_a_steps_masks_reach_the_device_without_a_copy(tiny: tuple[Any, Any]) -> None:
    """The decode step fills its grammar rows' masks in place into one of two MLX arrays its
    plan keeps, by turns, and hands that array to the sampling as it is: no copy of the
    batch's bitmask each step. The array a step got still holds that step's masks while the
    next step fills the other one (its sampling may still be reading it)."""
    from trio_mlx.actor._decode import Decoder, DecodeRow
    from trio_mlx.actor._protocol import SamplingParams

    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": ITEMS}})
    assert grammar is not None
    rows = [DecodeRow(SamplingParams(temperature=0.0), grammar=GrammarProcessor(vocab, grammar.source, 60))
            for _ in range(3)]
    decoder, fed, rng = Decoder(), None, np.random.default_rng(5)
    handed: list[Any] = []
    seen: list[np.ndarray] = []
    for _ in range(6):
        plan = decoder._plan_for(rows, vocab.size)
        masks = decoder._masks(plan, fed)
        assert plan.bitmask is not None
        words = plan.bitmask.view(np.uint32)
        assert np.array_equal(np.array(masks), words)  # what the host filled is what the device gets
        if handed:  # the last step's array is untouched by this step's fill
            assert np.array_equal(np.array(handed[-1]), seen[-1])
        handed.append(masks)
        seen.append(words.copy())
        fed = []
        for j in range(len(rows)):
            allowed = np.flatnonzero(np.unpackbits(words[j].view(np.uint8), bitorder="little"))
            fed.append(int(rng.choice(allowed[allowed != vocab.eos[0]] if len(allowed) > 1 else allowed)))
    assert len({id(m) for m in handed}) == 2 and handed[0] is handed[2] is handed[4]
    assert any(not np.array_equal(seen[k], seen[k + 1]) for k in range(len(seen) - 1))


def test_a_grammar_start_is_walked_once(tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that share a grammar share its completion from the start: the walk that
    finds it (milliseconds for a long schema) runs for the first row alone, and each
    row gets its own copy of it."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])
    assert grammar is not None
    walks: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return finish(*args, **kwargs)

    monkeypatch.setattr(_constrain, "finish", counted)
    _constrain._START_TAILS.pop(vocab, None)
    procs = [GrammarProcessor(vocab, grammar.source, 40) for _ in range(4)]
    for p in procs:
        if p.begin(None):
            p.fill()
            p.complete()
    assert len(walks) == 1
    tails = [p._tail for p in procs]
    assert tails[0] and all(t == tails[0] for t in tails)
    procs[0]._tail.pop(0)
    assert procs[1]._tail == tails[1] and len(procs[1]._tail) == len(procs[0]._tail) + 1


def test_rows_alive_together_get_more_lexers_than_the_pool_has_threads(
        tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one grammar alive together each get a start (a lexer) of their own past one per
    thread of llguidance's pool: with one start per thread, a wide batch put several rows on
    each lexer, and the pool's threads and the budget checks beside them waited on one
    another's lexer lock. Their masks are those of one start."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])
    assert grammar is not None
    monkeypatch.setattr(_constrain, "_STARTS", weakref.WeakKeyDictionary())
    n = _constrain.POOL_THREADS + 1
    procs = [GrammarProcessor(vocab, grammar.source, 40) for _ in range(n)]
    assert sorted(p.lexer for p in procs) == list(range(n))
    tail = finish(llguidance.LLMatcher(vocab.tokenizer, grammar.source, log_level=0), vocab)
    assert tail
    fed = _masks_of(procs[0], tail[:3])
    assert all(np.array_equal(_masks_of(p, tail[:3]), fed) for p in procs[1:])


def test_the_starts_kept_over_all_grammars_are_bounded(
        tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lexer a grammar's rows used stays with its start, a few MB: past `_STARTS_TOTAL`
    starts over all the grammars kept, a new start drops the idle ones (no live row) of the
    grammars used before it, each grammar's last first, down to its first; starts with live
    rows stay, and the grammars keep working."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    texts = []
    for fmt in (FORMATS[1][1], FORMATS[2][1], FORMATS[0][1]):
        grammar = _grammar.compile_response_format(tok, fmt)
        assert grammar is not None
        texts.append(grammar.source)
    monkeypatch.setattr(_constrain, "_STARTS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(_constrain, "LEXERS", 3)
    monkeypatch.setattr(_constrain, "_STARTS_TOTAL", 4)

    def counts() -> list[int]:
        kept = _constrain._STARTS[vocab]
        return [len(kept[t].matchers) for t in texts if t in kept]

    idle = [GrammarProcessor(vocab, texts[0], 40) for _ in range(3)]
    live = [GrammarProcessor(vocab, texts[1], 40) for _ in range(2)]
    assert counts() == [3, 2]
    for p in idle:
        p.retire()  # ended: its start holds no live row
    more = [GrammarProcessor(vocab, texts[1], 40)]
    assert counts() == [1, 3]  # 6 kept: the first grammar's idle starts went, its last first
    more += [GrammarProcessor(vocab, texts[2], 40) for _ in range(2)]
    assert counts() == [1, 3, 2]  # its first start stays, and so do the live rows' starts
    assert all(p.lexer < 3 for p in live + more)
    fresh = GrammarProcessor(vocab, texts[0], 40)
    assert fresh.lexer == 0 and counts()[0] == 1
    tail = finish(llguidance.LLMatcher(vocab.tokenizer, texts[0], log_level=0), vocab)
    monkeypatch.setattr(_constrain, "_STARTS", weakref.WeakKeyDictionary())
    alone = GrammarProcessor(vocab, texts[0], 40)  # from a start of its own
    assert tail and np.array_equal(_masks_of(fresh, tail[:2]), _masks_of(alone, tail[:2]))


def test_rows_that_share_a_grammar_compile_it_once_per_lexer(
        tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows of one grammar text start from copies of its start matchers, each row on the
    start with the fewest live rows: llguidance compiles the grammar again (milliseconds for an
    agent's tools, on the actor thread) only while every start has rows, up to
    `_constrain.LEXERS` starts, since copies of one matcher share its lexer's lock. Rows one at a
    time (an agent's turns) compile it once. Each row's matcher is its own. A grammar that
    does not compile is refused every time, not kept."""
    import types

    _, tok = tiny
    vocab = grammar_vocab(tok)
    grammar = _grammar.compile_response_format(tok, FORMATS[2][1])
    assert grammar is not None
    tail = finish(llguidance.LLMatcher(vocab.tokenizer, grammar.source, log_level=0), vocab)
    assert tail and len(tail) >= 3
    built: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return llguidance.LLMatcher(*args, **kwargs)

    monkeypatch.setattr(_constrain, "llguidance", types.SimpleNamespace(LLMatcher=counted))
    monkeypatch.setattr(_constrain, "LEXERS", 2)
    _constrain._STARTS.pop(vocab, None)
    for _ in range(3):  # one row at a time: each ends before the next comes
        assert GrammarProcessor(vocab, grammar.source, 40).lexer == 0
    assert len(built) == 1
    procs = [GrammarProcessor(vocab, grammar.source, 40) for _ in range(4)]
    assert len(built) == 2
    assert [p.lexer for p in procs] == [0, 1, 0, 1]
    fed = _masks_of(procs[0], tail[:3])
    assert np.array_equal(_masks_of(procs[2], tail[:3]), fed)  # a row starts where the one before it on its start did
    assert np.array_equal(_masks_of(procs[1], tail[:3]), fed)  # ... and on the other start alike
    assert np.array_equal(_masks_of(procs[3], []), fed[:1])  # ... and the last, untouched by all
    del procs[3], procs[1]  # start 1's rows end: it takes the next row, with no new start
    assert GrammarProcessor(vocab, grammar.source, 40).lexer == 1 and len(built) == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="does not compile"):
            GrammarProcessor(vocab, "start: nowhere", 40)
    assert len(built) == 4 and "start: nowhere" not in _constrain._STARTS[vocab]


def test_jump_walks_only_for_tokens_that_open_something(tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a JSON string every opener is text or the completion's own closing quote:
    `jump` finds that by validating, with no walk; after a key's colon, a value that
    opens an object lengthens the completion, and `jump` walks for it."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {}}, "required": ["a"]}
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    assert grammar is not None
    walks: list[int] = []
    real = _matcher.finish

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return real(*args, **kwargs)

    def at(text: str) -> tuple[Any, list[int], np.ndarray]:
        m = llguidance.LLMatcher(vocab.tokenizer, grammar.source)
        for t in tok.encode(text):
            assert m.consume_token(t)
        tail = real(m, vocab)
        assert tail is not None
        bitmask = llnp.allocate_token_bitmask(1, vocab.size)
        llnp.fill_next_token_bitmask(m, bitmask)
        return m, tail, bitmask.view(np.uint32)

    inside = at('{"a": "x')
    outside = at('{"a": "x", "b": ')
    monkeypatch.setattr(_matcher, "finish", counted)
    assert jump(inside[0], vocab, inside[1], inside[2]) == 0
    assert not walks
    assert jump(outside[0], vocab, outside[1], outside[2]) > 0
    assert walks


@pytest.mark.parametrize("specials", [3, 100], ids=["few-specials", "many-specials"])
def test_jumpers_are_the_openers_and_specials_the_mask_allows(tiny: tuple[Any, Any], specials: int) -> None:
    """`jumpers` reads the mask one way for a few special tokens and another for many: both
    give the openers, then the special tokens, that the bitmask lets through."""
    import dataclasses

    _, tok = tiny
    vocab = grammar_vocab(tok)
    rng = np.random.default_rng(specials)
    vocab = dataclasses.replace(vocab, specials=np.sort(rng.choice(vocab.size, specials, replace=False)))
    for density in (0.0, 0.1, 0.5, 1.0):
        bits = rng.random(vocab.size) < density
        words = np.packbits(np.pad(bits, (0, -vocab.size % 32)), bitorder="little").view(np.uint32)
        expected = [t for t in (*vocab.openers, *vocab.specials.tolist()) if bits[t]]
        assert _matcher.jumpers(vocab, words.reshape(1, -1)) == expected


def test_processor_never_raises(tiny: tuple[Any, Any]) -> None:
    """A token the grammar refuses (impossible while the mask holds) ends the row with
    EOS and records why, rather than failing the batch's step."""
    _, tok = tiny
    vocab = grammar_vocab(tok)
    proc = GrammarProcessor(vocab, _grammar.compile_response_format(tok, FORMATS[0][1]).source, 50)  # type: ignore[union-attr]
    proc(mx.array([5]), mx.zeros((1, vocab.size)))
    out = proc(mx.array([5, tok.encode("]")[0]]), mx.zeros((1, vocab.size)))
    assert np.flatnonzero(np.isfinite(np.array(out[0]))).tolist() == list(vocab.eos)
    assert proc.error is not None and "refused" in proc.error


@pytest.mark.parametrize(
    "response_format,needle",
    [
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}, "nowhere"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}}, "regex"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "strange"}}}, "strange"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "weird"}, "strict": True}}, "weird"),
        ({"type": "json_schema", "json_schema": {"schema": ["not", "a", "schema"]}}, "must be an object"),
        ({"type": "json_schema", "json_schema": "nope"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {"const": float("nan")}}}, "not JSON"),
        ({"type": "yaml"}, "'yaml'"),
        ("json", "must be an object"),
    ],
)
def test_a_schema_that_cannot_compile_is_a_clear_400(tiny: tuple[Any, Any], response_format: Any, needle: str) -> None:
    _, tok = tiny
    with pytest.raises(InvalidRequestError) as info:
        _grammar.compile_response_format(tok, response_format)
    assert needle in info.value.message and info.value.param == "response_format"


def test_lenient_unless_strict(tiny: tuple[Any, Any]) -> None:
    """OpenAI's default (strict absent or false) ignores keywords the engine lacks."""
    _, tok = tiny
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}
    assert _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert _grammar.compile_response_format(tok, {"type": "text"}) is None
    assert _grammar.compile_response_format(tok, None) is None


def test_max_tokens_below_the_sure_completion_is_a_400(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    grammar = _grammar.compile_response_format(tok, FORMATS[1][1])
    assert grammar is not None and grammar.min_tokens > 10  # the required keys take tokens
    _grammar.check_max_tokens(grammar, grammar.min_tokens)
    with pytest.raises(InvalidRequestError, match="can take") as info:
        _grammar.check_max_tokens(grammar, grammar.min_tokens - 1)
    assert info.value.param == "max_tokens"


def test_a_grammar_pickles_for_the_process_actor(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    grammar = _grammar.compile_response_format(tok, FORMATS[1][1])
    assert pickle.loads(pickle.dumps(grammar)) == grammar


def test_the_vocab_is_built_once_per_tokenizer(tiny: tuple[Any, Any], tiny_model_fp32: Path) -> None:
    """Built once, and findable by the model's path: a thread actor reuses the engine's."""
    _, tok = tiny
    # a key no other test used: engines in earlier tests keep their vocab under the model's path
    key = str(tiny_model_fp32 / "test_the_vocab_is_built_once_per_tokenizer")
    vocab = grammar_vocab(tok)
    assert grammar_vocab(tok) is vocab and cached_vocab(key) is None
    assert grammar_vocab(tok, key=key) is vocab
    assert cached_vocab(key) is vocab
    # Specials: <|endoftext|>, <|im_start|> (and the byte 0xFF, which llguidance reserves);
    # EOS is not among them: a finished grammar allows it.
    assert vocab.size == 512 and vocab.eos == (2,) and vocab.specials.tolist()[:2] == [0, 1]
    assert 2 not in vocab.specials


@pytest.mark.slow
def test_embedded_model_answers_in_the_schema(embedded_model: Path) -> None:
    """The real model's tokenizer (49152 ids, GGUF-converted) works with llguidance,
    and the real model, constrained, answers in the schema."""
    model, _ = models.load_model(embedded_model)
    tok = models.load_tokenizer(embedded_model)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    chat = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
    (row,) = run_rows(model, tok, [Row(prompt, 48, grammar.source)])
    answer = json.loads(row.text(tok))
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["city"] and row.processor is not None and not row.processor.forced_finish


@pytest.mark.slow
def test_what_must_fit_a_budget_is_the_completion_as_the_tokenizer_spells_it(embedded_model: Path) -> None:
    """Where nothing is forced, `finish` walks a byte a token: an array of 60 strings closes
    in 240 of SmolLM2's tokens (`"`, `"`, `,`, ` ` an item), which the tokenizer spells in 62.
    The engine took the walk's length for the least max_tokens (refusing 160), and a row
    forced to close wrote the walk, cut at its max_tokens into text that does not parse.
    Both now take the tokenizer's spelling (validated: the grammar reads bytes), and rows
    held to a budget under the walk's length end in the schema."""
    tok = models.load_tokenizer(embedded_model)
    vocab = grammar_vocab(tok)
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60, "maxItems": 60}
    grammar = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    matcher = llguidance.LLMatcher(vocab.tokenizer, grammar.source)
    walked = finish(matcher, vocab)
    assert walked is not None
    short = respelled(matcher, vocab, walked)
    assert len(short) <= 70 < len(walked) and completes(matcher, vocab, short)
    assert vocab.tokenizer.decode_bytes(short) == vocab.tokenizer.decode_bytes(walked)
    assert grammar.min_tokens == len(short) + 1
    _grammar.check_max_tokens(grammar, 160)
    rng = np.random.default_rng(0)
    for _ in range(4):
        proc = GrammarProcessor(vocab, grammar.source, 160)
        tokens, _ = _random_row(proc, rng, vocab)
        assert len(tokens) <= 160 and proc.error is None and proc.forced_finish
        jsonschema.validate(json.loads(vocab.tokenizer.decode_bytes(tokens[:-1])), schema)


def test_bf16_logits(tiny_model_bf16: Path) -> None:
    """The mask holds for bfloat16 logits, as a GPU model produces them."""
    model, _ = models.load_model(tiny_model_bf16)
    tok = models.load_tokenizer(tiny_model_bf16)
    rows = []
    for _, response_format, _ in FORMATS:
        grammar = _grammar.compile_response_format(tok, response_format)
        assert grammar is not None
        rows += [Row(tok.encode(p), grammar.min_tokens + 30, grammar.source, t) for p in PROMPTS[:2] for t in (0.0, 1.0)]
    run_rows(model, tok, rows)
    for i, row in enumerate(rows):
        check(row.text(tok), FORMATS[i // 4][2])
