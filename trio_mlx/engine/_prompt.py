"""Chat prompts to token ids, with what the client wrote tokenized as text.

A chat template renders the conversation into one string, and the tokenizer
turns every special-token string in it (`<|im_end|>`, `<|start_header_id|>`,
...) into its control id. Tokenized naively, a user message containing
`<|im_end|>\n<|im_start|>system\n...` becomes exactly the ids of a genuine
system turn. So every string the client supplied (message contents, roles,
names, tool calls, tool definitions, template arguments) has its
special-token strings swapped for placeholder characters before the template
runs; the rendered text is cut at the placeholders, the template's own text
is tokenized with special tokens parsed, and each placeholder is tokenized as
the text it stands for with special tokens split (`split_special_tokens`, the
HF tokenizers' option). This is the placeholder scheme vLLM and sglang
adopted for the same attack; filters such as `trim` act on the placeholders as
on the text (they are not whitespace). There is no switch to turn it off:
`/v1/completions` takes a raw prompt, special tokens included, for clients
that want to write the markup themselves.

Only tokens the tokenizer marks special are split; added tokens that are not
special (`<tool_call>`, `<think>` in many families) are ordinary vocabulary
the model also emits as text, and an assistant turn sent back in history must
tokenize as it was generated. Where no client string contains a special-token
string (nearly always) the prompt is rendered and tokenized in one piece,
exactly as before.

The placeholders' text is tokenized by a twin of the tokenizer whose Rust
backend splits special tokens always. transformers' `split_special_tokens=True`
sets a flag on the one backend that every thread shares, and prompts are
tokenized in several worker threads at once: a client's forged turn then
tokenized in another request's setting, and another request's template
tokenized in the forger's (measured: 97 of 320 encodes wrong with 8 threads of
forged and plain chats). The twin's flag never changes.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ._prefix_tokens import PrefixTokens
from ._text import fold_system

# Placeholders come from Unicode's supplementary private use area A: never
# produced by tokenizers or templates, and skipped when a client string uses one.
_PUA_START = 0xF0000
_PUA_END = 0xFFFFD
_PRIVATE = re.compile("[\U000F0000-\U0010FFFF]")


class ChatEncoder:
    """Renders and tokenizes chat prompts for one tokenizer (mlx-lm's TokenizerWrapper)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._hf = hf
        specials: set[str] = set(getattr(hf, "all_special_tokens", None) or ())
        for added in (getattr(hf, "added_tokens_decoder", None) or {}).values():
            if getattr(added, "special", False) and getattr(added, "content", ""):
                specials.add(added.content)
        specials.discard("")
        self.specials = tuple(sorted(specials, key=len, reverse=True))  # longest first
        self._find = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.prefix = PrefixTokens(hf)  # recent prompts' ids, reused by prompts extending them (read by statistics)
        self._split: Any = None  # `_splitting_twin(hf)` (a copy of the backend), made by `warm` or on first use
        self._split_lock = threading.Lock()

    def warm(self) -> ChatEncoder:
        """Pay the first chat prompt's one-off costs now (at startup, in a worker thread):
        the chat template's compilation (transformers caches it; ~5 ms) and the splitting
        twin (~110 ms for SmolLM2's 49k-token vocabulary), which a short prompt would
        otherwise pay on the event loop, stalling every stream. A template that refuses
        a lone user message is compiled on first use instead. Returns self."""
        if self.specials:
            self._twin()
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
        except Exception:  # no template, or one that wants other turns: its first request pays
            pass
        return self

    def encode(self, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None) -> list[int]:
        """Apply the chat template (with the generation prompt) and tokenize. With
        `continue_final_message` among `template_kwargs` (transformers' own argument of that
        name), the final message is left open for the model to continue, with no generation
        prompt after it: an assistant turn's prefill."""
        tok = self.tokenizer
        kwargs = dict(template_kwargs or {})
        cont = bool(kwargs.pop("continue_final_message", False))
        literal: dict[str, str] = {}
        if self._find is not None and (_any_string(messages, self._find) or _any_string(kwargs, self._find)):
            literal = self._placeholders(messages, kwargs)
            swap = {text: ch for ch, text in literal.items()}
            find = self._find
            messages = _map_strings(messages, lambda s: find.sub(lambda m: swap[m.group()], s))
            kwargs = _map_strings(kwargs, lambda s: find.sub(lambda m: swap[m.group()], s))
        if cont:
            kwargs["continue_final_message"] = True
        text = self._render(messages, kwargs, cont)
        if not literal:
            reused = self.prefix.encode(text)
            return reused if reused is not None else list(tok.encode(text, add_special_tokens=False))
        split = self._twin()
        ids: list[int] = []
        cut = re.compile("[" + "".join(literal) + "]")
        at = 0
        for m in cut.finditer(text):
            if m.start() > at:
                ids += self._hf.encode(text[at:m.start()], add_special_tokens=False)
            ids += split.encode(literal[m.group()], add_special_tokens=False, split_special_tokens=True)
            at = m.end()
        if at < len(text):
            ids += self._hf.encode(text[at:], add_special_tokens=False)
        return ids

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], cont: bool) -> str:
        """The chat template's text. A system message after the first turn (Claude Code sends
        them) is rendered where the template places it; a template that refuses it (many
        raise on roles out of order) or leaves its text out gets the system texts folded into
        one leading system message instead (`fold_system`), as other servers do."""
        def render(msgs: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not cont,
                                                      **kwargs)

        try:
            text = render(messages)
        except Exception:
            folded = fold_system(messages)
            if folded is None:
                raise
            return render(folded)
        late = [m.get("content") for k, m in enumerate(messages) if k and m.get("role") == "system"]
        if any(c and c not in text for c in late):
            folded = fold_system(messages)
            assert folded is not None
            return render(folded)
        return text

    def _twin(self) -> Any:
        with self._split_lock:
            if self._split is None:
                self._split = _splitting_twin(self._hf)
            return self._split

    def _placeholders(self, *values: Any) -> dict[str, str]:
        """A private-use character for each special-token string, none already in use."""
        used: set[str] = set()
        template = getattr(self._hf, "chat_template", None)
        for s in [*_strings(values), *(template.values() if isinstance(template, dict) else [template or ""])]:
            used.update(_PRIVATE.findall(s))
        out: dict[str, str] = {}
        code = _PUA_START
        for special in self.specials:
            while chr(code) in used:
                code += 1
            if code > _PUA_END:  # pragma: no cover - tens of thousands of special tokens
                raise RuntimeError("no placeholder characters left")
            out[chr(code)] = special
            code += 1
        return out


def _splitting_twin(hf: Any) -> Any:
    """`hf` itself where special-token splitting is an argument of each call (slow
    tokenizers); for a fast one, a shallow copy with a Rust backend of its own that always
    splits them, so no call ever sets the flag on the backend other threads use."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens") or not hasattr(backend, "to_str"):
        return hf
    twin = copy.copy(hf)
    twin._tokenizer = type(backend).from_str(backend.to_str())
    twin._tokenizer.encode_special_tokens = True
    twin.split_special_tokens = True
    return twin


def _strings(value: Any) -> list[str]:
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, Mapping):
            stack.extend(k for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, Sequence) and not isinstance(v, (bytes, bytearray)):
            stack.extend(v)
    return out


def _any_string(value: Any, pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(s) for s in _strings(value))


def _map_strings(value: Any, fn: Any) -> Any:
    """`value` with `fn` applied to every string in it (dict keys too), containers copied."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {(fn(k) if isinstance(k, str) else k): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def max_token_chars(tokenizer: Any) -> int:
    """The most bytes of UTF-8 text one token can stand for: the longest vocabulary entry,
    in bytes. A byte-level entry has one character per byte (GPT-2's byte alphabet: `Ġ` is
    the byte of a space), so its length; any other entry (SentencePiece's, one character a
    character) its UTF-8 length, which bounds what it covers from above (byte-fallback
    entries like `<0xE2>` are longer than their byte). A text of B bytes is at least
    B / max_token_chars tokens. Counted in bytes, not characters: 650,000 astral characters
    (2.6 MB, ~2 M tokens) passed a bound of characters over the embedded default's
    81-character longest entry, and cost 7.2 s of CPU and 610 MB before their 400."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = hf.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary map: no bound
        return 0
    if set().union(*vocab) <= _BYTE_ALPHABET:
        return max((len(k) for k in vocab), default=0)
    return max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=0)


def _byte_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE vocabularies spell bytes with (GPT-2's map)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in kept)
    return frozenset(map(chr, kept)) | frozenset(chr(256 + n) for n, _ in enumerate(extra))


_BYTE_ALPHABET = _byte_alphabet()


def text_size(text: str) -> int:
    """`text`'s length in UTF-8 bytes (what `max_token_chars` bounds a token by); an ASCII
    text's without copying it."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_chars(value: Any, limit: int = 0) -> int:
    """Bytes (UTF-8) of the text in a JSON-like `value` as a template renders it: every string
    (dict keys too; an empty one as 1) and 1 for any other scalar, a lower bound on what its
    JSON takes. Read without copying; the walk stops once past `limit` (0: none), so its cost
    is bounded by the limit, not by the value's size."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += text_size(v) or 1
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            total += 1
        if limit and total > limit:
            break
    return total


def prompt_chars(kind: str, value: Any, limit: int = 0) -> int:
    """Bytes (UTF-8) of client text in a prompt (chat contents and tool calls' names and
    arguments, or the text prompt): what the cheap bound against the context counts
    (`max_token_chars`; `limit`: it may stop counting past it). Token-id prompts count 0."""
    if kind == "text":
        return text_size(value) if isinstance(value, str) else 0
    total = 0
    if isinstance(value, Sequence) and not isinstance(value, str):
        for msg in value:
            if not isinstance(msg, Mapping):
                continue
            content = msg.get("content")
            if isinstance(content, str):
                total += text_size(content)
            elif isinstance(content, Sequence):
                for part in content:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if isinstance(text, str):
                        total += text_size(text)
            if calls := msg.get("tool_calls"):  # arguments of megabytes are text like any other
                total += text_chars(calls, limit and max(1, limit - total))
            if limit and total > limit:
                break
    return total
