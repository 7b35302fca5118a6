"""The prompts of `trio-mlx bench`: random token ids of an exact token length under the
model's tokenizer, each one distinct so that prefix caches don't flatter; each request's
answer length (`request_lengths`); and the model whose tokenizer makes them, named by
`--model` or by the server's `GET /v1/models`."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    ids: tuple[int, ...]  # what the server's tokenizer makes of it, template included (chat)


def load_tokenizer(model: str) -> Any:
    from .. import models

    return models.load_tokenizer(models.resolve_model(model))


def make_prompts(
    tokenizer: Any, n: int, length: int, *, seed: int = 0, chat: bool = False
) -> list[Prompt]:
    """`n` distinct prompts that the tokenizer encodes to exactly `length` tokens.

    Random token ids are decoded to text and the text re-encoded the way a
    server does (`encode(text)` with the tokenizer's default special tokens,
    or the chat template around a user message); merges across token
    boundaries change the count, so ids are dropped or added until it fits.
    """
    if chat:

        def encode(text: str) -> list[int]:
            return list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True
                )
            )
    else:

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text))

    overhead = len(encode(""))
    if length - overhead < 1:
        raise ValueError(f"prompt length {length} leaves no room after {overhead} template tokens")
    # Where the content starts (after a BOS or the chat template's head): no
    # two prompts share their first two content tokens, so no prefix cache
    # can reuse one prompt's work for another beyond the template itself.
    a, b = encode("hello"), encode("world")
    lead = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    ordinary = _ordinary_ids(tokenizer)
    if len(ordinary) < 2:
        raise ValueError("the tokenizer has no ordinary tokens to draw from")
    rng = random.Random(seed)

    def draw() -> int:
        return ordinary[rng.randrange(len(ordinary))]

    prompts: list[Prompt] = []
    heads: set[tuple[int, ...]] = set()
    for _attempt in range(100 * n + 100):  # arbitrary bound: fails loudly, never spins
        if len(prompts) == n:
            break
        content = [draw() for _ in range(length - overhead)]
        for _ in range(64):  # arbitrary; it fits within a few rounds in practice
            text = tokenizer.decode(content)
            ids = tuple(encode(text))
            diff = len(ids) - length
            if diff == 0:
                head = ids[lead : lead + 2]
                if head not in heads:
                    heads.add(head)
                    prompts.append(Prompt(text, ids))
                break
            if diff > 0:
                content = content[:-diff] if diff < len(content) else [draw()]
            else:
                content += [draw() for _ in range(-diff)]
    else:
        raise ValueError(f"could not make {n} distinct prompts of {length} tokens")
    return prompts


def _ordinary_ids(tokenizer: Any) -> list[int]:
    """The ids encoding can produce: a token decoded alone re-encodes to itself.

    That leaves out special and added tokens (`<|im_end|>`), vocabulary
    padding no merge reaches (the test models' `<|x123|>`), and lone pieces of
    multi-byte characters. One batch through the Rust tokenizer when there is
    one (~1 s for a 128k vocabulary on 2 cores), else one id at a time.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx_lm's TokenizerWrapper wraps HF's
    banned = set(getattr(hf, "all_special_ids", None) or [])
    banned |= set(getattr(hf, "added_tokens_decoder", None) or {})
    ids = [i for i in range(len(hf)) if i not in banned]
    rust: Any = getattr(hf, "_tokenizer", None)
    if hasattr(rust, "decode_batch") and hasattr(rust, "encode_batch"):
        texts = rust.decode_batch([[i] for i in ids], skip_special_tokens=False)
        again = [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]
    else:
        again = [hf.encode(hf.decode([i]), add_special_tokens=False) for i in ids]
    return [i for i, e in zip(ids, again, strict=True) if list(e) == [i]]


def model_from_server(url: str, timeout: float) -> tuple[str, str]:
    """(a model reference to load the tokenizer from, the served id), from GET /v1/models:
    the card's `root` (the directory the server loaded, as vLLM names it) when it exists
    here, else its id (the embedded default's, or a hub id, resolves as such)."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=min(timeout, 30.0))
        resp.raise_for_status()
        card = (resp.json().get("data") or [None])[0]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise SystemExit(f"trio-mlx bench: no --model given and {url}/v1/models failed: {exc}") from None
    if not isinstance(card, dict) or not isinstance(card.get("id"), str):
        raise SystemExit(f"trio-mlx bench: {url}/v1/models names no model; pass --model")
    root = card.get("root")
    if isinstance(root, str) and Path(root).is_dir():
        return root, card["id"]
    return card["id"], card["id"]


def request_lengths(n: int, max_tokens: int, spread: float, *, seed: int = 0) -> list[int]:
    """Each of `n` requests' max_tokens: `max_tokens` for all with no `spread`, else drawn
    uniformly from [max_tokens x (1 - spread), max_tokens x (1 + spread)] (at least 1), seeded,
    so that every target of a run gets the same lengths. With one length for all, a closed
    loop's requests start and end together, in waves; traffic's end apart, and a batch pays
    for that (each new prompt enters beside decoding rows), so lengths that differ measure
    what serving does (vLLM's bench draws its lengths so with `--random-range-ratio`)."""
    if not 0 <= spread < 1:
        raise ValueError(f"a max_tokens spread is in [0, 1), got {spread}")
    if not spread:
        return [max_tokens] * n
    rng = random.Random(f"lengths-{seed}")  # apart from the prompts' draws: they stay as they were
    low, high = max(1, round(max_tokens * (1 - spread))), max(1, round(max_tokens * (1 + spread)))
    return [rng.randint(low, high) for _ in range(n)]
