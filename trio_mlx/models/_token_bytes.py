"""A token's own bytes, for logprobs: what a token id stands for before UTF-8 decoding.

Decoding one token alone turns a token that holds part of a character (an emoji's
first bytes, in byte-level BPE) into U+FFFD, so OpenAI's logprob `bytes` (meant to
rebuild the text when joined) and its legacy completions' `top_logprobs` (keyed by
token text) lost what the tokens were. The bytes come from the vocabulary mlx-lm's
streaming detokenizer holds (`tokenmap`): byte-level BPE's characters mapped back
through GPT-2's byte table, SentencePiece's `<0xNN>` byte tokens and `▁` spaces;
a tokenizer with neither falls back to its decoded text.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_SPM_SPACE = "\u2581".encode()
_cache: weakref.WeakKeyDictionary[Any, Callable[[int], bytes]] = weakref.WeakKeyDictionary()


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE writes to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """`id -> bytes` for an mlx-lm TokenizerWrapper (made once per tokenizer)."""
    try:
        return _cache[tokenizer]
    except (KeyError, TypeError):
        pass
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    detokenizer = getattr(tokenizer, "detokenizer", None)
    tokenmap = getattr(detokenizer, "tokenmap", None)

    def decoded(token: int) -> bytes:
        return str(tokenizer.decode([token])).encode()

    if isinstance(detokenizer, BPEStreamingDetokenizer) and tokenmap is not None:
        table = _gpt2_byte_decoder()

        def bpe(token: int) -> bytes:
            if not 0 <= token < len(tokenmap) or tokenmap[token] is None:
                return decoded(token)
            # a character outside the table (an added token's) stands for itself, as mlx-lm reads it
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in tokenmap[token])

        find = bpe
    elif isinstance(detokenizer, SPMStreamingDetokenizer) and tokenmap is not None:
        def spm(token: int) -> bytes:
            if not 0 <= token < len(tokenmap):
                return decoded(token)
            return tokenmap[token].replace(_SPM_SPACE, b" ")

        find = spm
    else:
        find = decoded
    try:
        _cache[tokenizer] = find
    except TypeError:  # not weakly referable: made again next time
        pass
    return find


def token_text(raw: bytes) -> str:
    """A token's text for logprobs: its bytes decoded, or, where they are not whole UTF-8
    characters, OpenAI's form for such a token, `bytes:\\xNN...`."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
