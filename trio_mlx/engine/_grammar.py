"""Structured output: compile a request's response format into a grammar the actor enforces.

The grammar engine is llguidance (Microsoft's; llama.cpp and vLLM use it):
it compiles JSON schemas and Lark grammars, lexes with derivative-based
regexes and an Earley parser, computes a token mask in microseconds, and
hands the mask over as a numpy bitmask, so the actor applies it with plain
MLX ops on any backend (outlines-core's MLX path is a Metal kernel, and
llguidance's own `llguidance.mlx` helper is Metal-only too).

Compilation happens here, on the trio side, before submission: the engine
calls `compile_response_format` (or `_tools.tool_grammar`) in a worker thread
(`trio.to_thread.run_sync`; llguidance drops the GIL while it builds a
grammar). What crosses to the actor is a `Grammar`: plain strings and an int,
so it pickles for the process actor. The actor builds its own matcher from
`Grammar.source` (`actor/_constrain.py`, about 0.5 ms for a small schema).

JSON comes out in one canonical spacing (`", "` and `": "`, no other
whitespace; `JSON_OPTIONS`): models know that shape best, and a grammar that
allowed free whitespace would let a weak model pad forever. A schema may
override it with llguidance's own `"x-guidance"` key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .._errors import InvalidRequestError
from ..actor._matcher import GrammarVocab, finish, grammar_vocab, is_panic, respelled
from ..actor._protocol import Grammar, GrammarKind

__all__ = [
    "Draft", "Grammar", "GrammarKind", "check_draft", "compile_json_schema", "compile_lark",
    "compile_response_format", "draft_lark", "draft_response_format",
]

# llguidance's JSON compiler options; a schema's "x-guidance" overrides them.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Bounds on what a request may make the grammar engine do: llguidance's own
# limits on the grammar's size and the work of one mask (its defaults, written
# out so that changing them is a visible decision), and on the schema text.
MAX_SCHEMA_BYTES = 256 * 1024  # arbitrary; OpenAI's structured outputs allow far less nesting
LIMITS: dict[str, Any] = dict(max_grammar_size=500_000, step_max_items=50_000, initial_lexer_fuel=1_000_000)

def vocab_for(tokenizer: Any, *, param: str | None = None) -> GrammarVocab:
    """The tokenizer in llguidance's form (built once per tokenizer), or a 400."""
    try:
        return grammar_vocab(tokenizer)
    except ValueError as exc:
        raise InvalidRequestError(
            f"this model's tokenizer does not support constrained decoding ({exc})", param=param
        ) from exc


@dataclass(frozen=True)
class Draft:
    """A grammar's text before it is checked against the tokenizer: cheap to make (the
    request's own JSON, rewritten); checking it (`check_draft`) is what may cost."""

    source: str
    kind: GrammarKind
    param: str | None


def compile_response_format(
    tokenizer: Any, response_format: Any, *, param: str = "response_format"
) -> Grammar | None:
    """OpenAI's `response_format` -> a Grammar, or None for plain text.

    `{"type": "text"}`: None. `{"type": "json_object"}`: any JSON object.
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`:
    that schema (`strict` may also sit beside `json_schema`). Raises
    InvalidRequestError, naming the problem, for anything else or a schema that
    does not compile. In this thread, with no bound on time or memory: the server
    checks drafts in its grammar checkers (`_grammar_pool.py`) instead.
    """
    draft = draft_response_format(response_format, param=param)
    return None if draft is None else check_draft(vocab_for(tokenizer, param=param), draft)


def draft_response_format(response_format: Any, *, param: str = "response_format") -> Draft | None:
    """`compile_response_format`'s grammar text, unchecked; None for plain text."""
    spec = _format_spec(response_format, param)
    if spec is None:
        return None
    kind, schema, strict = spec
    if kind == "json_object":
        return _draft_json(schema, strict=True, kind="json_object", param=param)
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{param}: the JSON schema must be an object", param=param)
    return _draft_json(schema, strict=strict, kind="json_schema", param=param)


def answer_schema(response_format: Any, *, param: str = "response_format") -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for, with llguidance's options inside it
    (`"x-guidance"`), for a Lark grammar's `%json {...}`; None for plain text."""
    spec = _format_spec(response_format, param)
    if spec is None:
        return None
    _, schema, strict = spec
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{param}: the JSON schema must be an object", param=param)
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, "lenient": not strict, **(own if isinstance(own, Mapping) else {})}
    return {**schema, "x-guidance": options}


def _format_spec(response_format: Any, param: str) -> tuple[str, Any, bool] | None:
    """`response_format` -> (type, schema, strict), or None for text; a 400 for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, {"type": "object"}, True
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequestError(
                f"{param}.json_schema must be an object with a 'schema'", param=param
            )
        schema = spec.get("schema", {})  # OpenAI's default: any JSON value
        strict = spec.get("strict", response_format.get("strict"))
        return kind, schema, strict is True
    raise InvalidRequestError(
        f"{param}.type must be 'text', 'json_object' or 'json_schema', not {kind!r}", param=param
    )


def compile_json_schema(
    tokenizer: Any, schema: Any, *, strict: bool = False, param: str = "response_format"
) -> Grammar:
    """A JSON schema -> a Grammar. With `strict` (OpenAI's default is False) every
    keyword the engine does not implement is an error; without it, such keywords
    are ignored (llguidance's "lenient" mode). Either way the output is held to
    the rest of the schema, and a schema that is wrong (a bad `$ref`, an invalid
    regex, an unknown type) is refused."""
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{param}: the JSON schema must be an object", param=param)
    draft = _draft_json(schema, strict=strict, kind="json_schema", param=param)
    return check_draft(vocab_for(tokenizer, param=param), draft)


def compile_lark(tokenizer: Any, lark: str, *, kind: GrammarKind = "lark", param: str | None = None) -> Grammar:
    """A Lark grammar in llguidance's dialect (it may inline `%json {...}`) -> a Grammar."""
    return check_draft(vocab_for(tokenizer, param=param), draft_lark(lark, kind=kind, param=param))


def draft_lark(lark: str, *, kind: GrammarKind = "lark", param: str | None = None) -> Draft:
    """`compile_lark`'s grammar text, unchecked."""
    return Draft(llguidance.LLMatcher.grammar_from_lark(lark), kind, param)


def check_max_tokens(grammar: Grammar, max_tokens: int, *, param: str = "max_tokens") -> None:
    """Refuse a max_tokens too small for the engine to be sure of a complete output."""
    if max_tokens < grammar.min_tokens:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}, but a complete output of this {grammar.kind} "
            f"can take {grammar.min_tokens} tokens; ask for at least that many",
            param=param,
        )


def _draft_json(schema: Mapping[str, Any], *, strict: bool, kind: GrammarKind, param: str) -> Draft:
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param}: the JSON schema is not JSON: {exc}", param=param) from exc
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"{param}: the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes", param=param
        )
    options = {**JSON_OPTIONS, "lenient": not strict}
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: invalid JSON schema: {exc}", param=param) from exc
    return Draft(source, kind, param)


def check_draft(vocab: GrammarVocab, draft: Draft) -> Grammar:
    """Validate a draft against the model's tokenizer and measure its shortest output: a
    Grammar, or InvalidRequestError naming the problem. A panic of the grammar library
    is the request's fault too. This is the part that may take long or much memory
    (a schema of many intersected patterns: seconds to minutes, gigabytes), so the
    server runs it in a child process it can kill (`_grammar_pool.py`)."""
    try:
        return _check(vocab, draft.source, draft.kind, draft.param)
    except BaseException as exc:
        if not is_panic(exc):
            raise
        what = "the JSON schema" if draft.kind in ("json_schema", "json_object") else "the grammar"
        raise InvalidRequestError(f"{draft.param or 'grammar'}: {what} cannot be enforced: the grammar "
                                  f"engine failed on it ({str(exc)[:200]})", param=draft.param) from None


def _check(vocab: GrammarVocab, source: str, kind: GrammarKind, param: str | None) -> Grammar:
    limits = llguidance.LLParserLimits(**LIMITS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        source, vocab.tokenizer, limits=limits
    )
    what = "the JSON schema" if kind in ("json_schema", "json_object") else "the grammar"
    if is_error:
        raise InvalidRequestError(
            f"{param or 'grammar'}: {what} cannot be enforced: {messages[0].strip()}", param=param
        )
    matcher = llguidance.LLMatcher(vocab.tokenizer, source, log_level=0, limits=limits)
    if matcher.is_error():  # validation passed; a limit the matcher hit first
        raise InvalidRequestError(
            f"{param or 'grammar'}: the grammar cannot be enforced: {matcher.get_error()}", param=param
        )
    # A grammar that meets one of llguidance's limits a few tokens in (a pattern of nested
    # counts, a schema that recurses without end) would fail mid-answer in the actor, and one
    # that admits no output at all would end at once: both are the request's fault, said
    # now. The first masks (`_first_masks`) and the completion's walk below find them.
    errors = _first_masks(matcher, vocab)
    # No completion found (the greedy walk can miss one, e.g. for some regex
    # patterns): the grammar still holds, but nothing bounds its shortest output.
    tail = finish(matcher, vocab, errors=errors) if not errors else None
    if errors:
        reason = _reason(errors[0])[:300] or "it admits no output"
        raise InvalidRequestError(f"{param or 'grammar'}: {what} cannot be enforced: {reason}", param=param)
    # The least max_tokens: the completion as the tokenizer spells it, and EOS (a row forced to
    # close writes that spelling, `_constrain.py`)
    return Grammar(source=source, min_tokens=1 if tail is None else len(respelled(matcher, vocab, tail)) + 1,
                   kind=kind)


# How many masks `_first_masks` computes: a few, as the actor will at the answer's start.
FIRST_MASKS = 8


def _first_masks(matcher: Any, vocab: GrammarVocab) -> list[str]:
    """The errors (none, or one) of a copy of `matcher` taken through its first
    FIRST_MASKS tokens as the actor takes it: a whole mask at each (llguidance's lexer
    builds its states for every token there, and that is where a pattern of nested
    counts passes its limit), then the forced tokens, or else the lowest allowed one."""
    m = matcher.deep_copy()
    bitmask = llnp.allocate_token_bitmask(1, vocab.size)
    bits = bitmask.view(np.uint8)
    for step in range(FIRST_MASKS):
        if m.is_accepting() or m.is_stopped():
            break
        llnp.fill_next_token_bitmask(m, bitmask)
        if m.is_error():
            if step == 0:  # no token may start the output
                return [f"it admits no output ({_reason(m.get_error())})"]
            break
        forced = m.compute_ff_tokens()
        allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
        if not forced and not len(allowed):
            break
        if not m.consume_tokens(forced[:1] or [int(allowed[0])]):
            break
    return [m.get_error()] if m.is_error() else []


def _reason(error: str) -> str:
    """llguidance's error without the matcher's state dump that follows it."""
    return error.split("<state>")[0].strip()
