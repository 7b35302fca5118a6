"""Text-side helpers that run on the trio side, never on the actor thread.

Stop-string matching across token boundaries, logprobs kept in step with the
text they belong to, the leading space of a completion, and normalising
OpenAI-style message content into what chat templates expect. Pure Python: no MLX here.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError


class StopMatcher:
    """Finds the earliest stop string in streamed text, holding back possible prefixes.

    `feed(text)` returns `(safe_text, stop)`: text that can be emitted now, and
    the stop string if one completed (the stop string itself is never
    emitted). Text that might be the start of a stop string is held back
    until the next feed proves otherwise or `flush()` releases it.
    """

    __slots__ = ("_stops", "_held")

    def __init__(self, stops: Iterable[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def __bool__(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, str | None]:
        buf = self._held + text
        best_at, best = -1, None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (best is None or at < best_at):
                best_at, best = at, stop
        if best is not None:
            self._held = ""
            return buf[:best_at], best
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return (buf[: len(buf) - keep] if keep else buf), None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class HeldLogprobs:
    """Per-token logprobs held back with their text, so that they match the content sent.

    A token's entry is recorded at the offset where its text starts in the
    detokenized stream (`token`), and goes out once released text reaches past
    that offset (`text(produced, released)`: what the detokenizer made and what
    the stop matcher let out of it). Entries whose text a stop string swallowed
    are never released; `rest()` releases all that is left at a normal end.
    """

    __slots__ = ("_held", "_produced", "_released")

    def __init__(self) -> None:
        self._held: collections.deque[tuple[int, Any]] = collections.deque()
        self._produced = 0
        self._released = 0

    def token(self, logprob: Any) -> None:
        self._held.append((self._produced, logprob))

    def text(self, produced: str, released: str) -> list[Any]:
        self._produced += len(produced)
        self._released += len(released)
        out = []
        while self._held and self._held[0][0] < self._released:
            out.append(self._held.popleft()[1])
        return out

    def rest(self) -> list[Any]:
        out = [lp for _, lp in self._held]
        self._held.clear()
        return out


def keep_leading_space(detokenizer: Any) -> None:
    """Make mlx_lm's streaming detokenizer keep the first token's leading space.

    Its BPE and SentencePiece detokenizers drop it (right at the start of a
    chat answer); a completion continues its prompt, so " Paris" after "The
    capital of France is" keeps the space, as `tokenizer.decode` gives it.
    Pinned by tests/integration/test_mlx_lm_internals.py.
    """
    if hasattr(detokenizer, "trim_space"):  # SPMStreamingDetokenizer's own switch
        detokenizer.trim_space = False
    elif hasattr(detokenizer, "_maybe_trim_space"):  # BPEStreamingDetokenizer: no switch
        detokenizer._maybe_trim_space = lambda text: text


# Content parts a text-only model cannot read, by their type in OpenAI's chat and Responses
# shapes (the Anthropic API translates its image and document blocks into these).
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file",
                "input_file": "file"}


def media_note(what: str) -> str:
    """The text that stands in for a media part the model cannot read (`normalize_messages`)."""
    return f"[{what} omitted: this model reads text only]"


def media_refusal(what: str) -> str:
    """Why a media part in the user's last turn is refused (`normalize_messages`; the other
    APIs' translations say the same under their own parameter names)."""
    return (f"this model reads text only, so {what} content cannot be served; send the text alone "
            f"(in an earlier turn it is replaced by a note, so the conversation can go on)")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> template-ready dicts: list-of-parts content becomes one string.

    The models served read text only. An image, audio or file part in the conversation's
    last message, when that is the user's, is refused with a 400 that says so: the client
    asked about it and can act on the answer. Anywhere else (an earlier turn, a tool's
    result) it becomes a short note (`media_note`), so that a conversation which once held
    one keeps working on its text turns, and an agent whose tool returned a screenshot
    learns that the model did not see it (as llama.cpp's server and LM Studio refuse, and
    agents keep history).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text":
                    texts.append(str(part.get("text", "")))
                elif isinstance(kind, str) and kind in _MEDIA_PARTS:
                    what = _MEDIA_PARTS[kind]
                    if i == last and msg.get("role") == "user":
                        raise InvalidRequestError(f"messages[{i}].content[{j}]: {media_refusal(what)}",
                                                  param=f"messages[{i}].content[{j}]", code="unsupported_content")
                    texts.append(("\n" if texts else "") + media_note(what) + "\n")
                else:
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}]: only text parts are supported, and images, audio "
                        "and files only as history",
                        param=f"messages[{i}].content",
                    )
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of text parts",
                param=f"messages[{i}].content",
            )
        out.append({**msg, "content": content})
    return out


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` with every system message after the first turn folded into one leading system
    message (their texts in order, a blank line apart), for a chat template that cannot place
    a system turn mid-conversation; None when there is none to fold."""
    late = [m for k, m in enumerate(messages) if m.get("role") == "system" and k > 0]
    if not late:
        return None
    systems = [m for m in messages if m.get("role") == "system"]
    text = "\n\n".join(str(m.get("content") or "") for m in systems if m.get("content"))
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": text}, *rest]
