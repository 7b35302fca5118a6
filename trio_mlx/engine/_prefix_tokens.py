"""Token ids of recent chat prompts, so that a prompt extending one is tokenized only past it.

Chat clients and agents resend their whole conversation every turn. Tokenizing
an 8k-token prompt takes milliseconds of CPU, with the GIL held by `tokenizers`'
single-text encode, so a follow-up's intake is a fair share of a short turn, and
when several conversations send at once their intakes run one after another
(BENCHMARKS.md, "Prompt cache"). Here a rendered
prompt that repeats a recent one up to and including one of its special tokens
reuses that one's ids and tokenizes only the rest, starting at that token.

Why the ids are the same as tokenizing the whole text: a Hugging Face
tokenizer first cuts its added tokens out of the text (leftmost-longest), then
normalizes, pre-tokenizes and models each stretch between them on its own. A
stretch's result depends on its text and on whether it starts the text
(Metaspace's `prepend_scheme="first"` reads its offset), nothing else. So if
the text through a special token S is the same as before, and S is cut out at
the same place, the ids before S are the same, and the rest tokenizes as the
text from S on does alone (S at its start, so the stretch after it does not
start the text, as in the whole). That holds when S is matched on the raw text
and alone: not normalized, no `lstrip`/`rstrip`/`single_word`, and no other
added token contains it (one could then match across the cut). Only such
specials (a chat template's `<|im_end|>`, `<|eot_id|>`, ...) serve as cuts,
and a cut is used only where both encodings show S's id at S's characters;
anything else tokenizes the whole text.

Only for tokenizers whose encoding is the stock one of transformers' fast
tokenizer (the Rust backend's, with no truncation, padding or special-token
splitting set): a subclass that preprocesses text (mlx-lm's
`NewlineTokenizer`) or a slow tokenizer keeps the plain path. Neither
`tokenizers` nor transformers nor mlx-lm tokenizes incrementally, and vLLM and
sglang tokenize every prompt whole, so this is written here.

Entries are keyed by the hashes of their text through each cut (one hash
updated across the text, copied at each cut) and checked against the text
before use; they are bounded by their characters, oldest out first.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import re
import threading
from array import array
from dataclasses import dataclass
from typing import Any

# The most characters of prompt text kept (with their ids, ~1 token a 4 characters):
# ~64 MB at most, room for the histories of a few hundred 8k-token conversations. Judgement.
MAX_CHARS = 1 << 25
# What transformers' stock encoding path is made of: a subclass overriding any of these
# does something of its own with the text, and keeps the plain path.
_ENCODE_METHODS = ("encode", "_encode_plus", "_batch_encode_plus", "encode_plus", "batch_encode_plus",
                   "__call__", "tokenize", "prepare_for_tokenization")


@dataclass(eq=False)
class _Entry:
    key: int
    text: str
    ids: array  # of token ids ("i": 4 bytes each)
    cuts: dict[int, int]  # character end of a cut special token -> its index in ids
    digests: list[bytes]  # the hash of text through each cut: its keys in the index


class PrefixTokens:
    """Tokenizes rendered chat prompts for one fast tokenizer, reusing recent prompts' ids.
    `encode(text)` returns the ids, or None where this tokenizer cannot be served here
    (`usable`); thread-safe: prompts are tokenized in several worker threads."""

    def __init__(self, hf: Any, max_chars: int = MAX_CHARS):
        self.max_chars = max_chars
        self._backend = _stock_backend(hf)
        self._cut_ids: dict[str, int] = _cut_tokens(self._backend) if self._backend is not None else {}
        self._cut_values = frozenset(self._cut_ids.values())
        self._find = (re.compile("|".join(map(re.escape, sorted(self._cut_ids, key=len, reverse=True))))
                      if self._cut_ids else None)
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._index: dict[bytes, int] = {}  # hash of a text through a cut -> an entry holding it
        self._keys = itertools.count()
        self._chars = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def usable(self) -> bool:
        return self._find is not None

    def encode(self, text: str) -> list[int] | None:
        backend = self._backend
        if self._find is None or backend is None or not _settings_stock(backend):
            return None
        marks = [(m.start(), m.end()) for m in self._find.finditer(text)]
        digests = _digests(text, [end for _, end in marks])
        base: _Entry | None = None
        start = end = 0
        for (a, b), digest in zip(reversed(marks), reversed(digests), strict=True):
            with self._lock:
                entry = self._entries.get(self._index.get(digest, -1))
                if entry is not None:
                    self._entries.move_to_end(entry.key)
            if entry is not None and b in entry.cuts and entry.text[:b] == text[:b]:
                base, start, end = entry, a, b
                break
        # An Encoding's `ids` builds a new list at each access (read once here), and so does
        # `offsets`, a tuple a token: 0.9 ms and 15k objects for the cyclic collector at 15k
        # tokens (on the CPU dev box), where `token_to_chars` reads one token's.
        enc = backend.encode_batch([text[start:]], add_special_tokens=False)[0]
        new_ids = enc.ids
        if base is not None and not (new_ids and new_ids[0] == self._cut_ids[text[start:end]]
                                     and enc.token_to_chars(0) == (0, end - start)):
            base, start = None, 0  # S was not cut where it was before: tokenize the whole text
            enc = backend.encode_batch([text], add_special_tokens=False)[0]
            new_ids = enc.ids
        head = base.ids[:base.cuts[end]] if base is not None else array("i")
        ids = head + array("i", new_ids)
        cuts = {b: k for b, k in base.cuts.items() if b < end} if base is not None else {}
        # The cuts tokenized here: tokens of a cut's id spanning exactly a mark. Found from the
        # ids (`char_to_token` a mark took ~11 us at 60k tokens: 92 ms for 4,096 messages).
        at_mark = {a - start: (a, b) for a, b in marks if a >= start}
        cut_values = self._cut_values
        for j in [j for j, t in enumerate(new_ids) if t in cut_values]:
            span = enc.token_to_chars(j)
            mark = at_mark.get(span[0]) if span is not None else None
            if (mark is not None and span == (mark[0] - start, mark[1] - start)
                    and new_ids[j] == self._cut_ids[text[mark[0]:mark[1]]]):
                cuts[mark[1]] = len(head) + j
        if base is not None:
            self.hits += 1
            self.reused_tokens += len(head)
        through = dict(zip((b for _, b in marks), digests, strict=True))
        self._store(_Entry(next(self._keys), text, ids, cuts, [through[b] for b in cuts]),
                    base if base is not None and max(base.cuts) <= end else None)
        return ids.tolist()

    def _store(self, entry: _Entry, redundant: _Entry | None) -> None:
        """Keep `entry`; `redundant` (an entry whose every cut `entry` holds too) goes."""
        if not entry.cuts or len(entry.text) > self.max_chars:
            return
        with self._lock:
            if redundant is not None and redundant.key in self._entries:
                self._drop(redundant.key)
            self._entries[entry.key] = entry
            self._chars += len(entry.text)
            for digest in entry.digests:
                self._index[digest] = entry.key
            while self._chars > self.max_chars:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        old = self._entries.pop(key)
        self._chars -= len(old.text)
        for digest in old.digests:
            if self._index.get(digest) == key:
                del self._index[digest]


def _settings_stock(backend: Any) -> bool:
    """No truncation, padding or special-token splitting set on the backend (what
    transformers' encode would undo or apply first)."""
    return backend.truncation is None and backend.padding is None and not backend.encode_special_tokens


def _digests(text: str, ends: list[int]) -> list[bytes]:
    """The hash of `text[:end]` for each of `ends` (ascending), in one pass over the text."""
    h = hashlib.blake2b(digest_size=16)
    out, at = [], 0
    for end in ends:
        h.update(text[at:end].encode("utf-8", "surrogatepass"))
        at = end
        out.append(h.copy().digest())
    return out


def _stock_backend(hf: Any) -> Any:
    """The Rust tokenizer behind `hf` where `hf.encode(text, add_special_tokens=False)` is
    exactly its `encode_batch([text], add_special_tokens=False)[0].ids`, else None."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not all(hasattr(backend, a) for a in ("encode_batch", "get_added_tokens_decoder",
                                                                 "truncation", "padding", "encode_special_tokens")):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        return None
    if not isinstance(hf, PreTrainedTokenizerFast) or getattr(hf, "split_special_tokens", False):
        return None
    if any(getattr(type(hf), m, None) is not getattr(PreTrainedTokenizerFast, m, None) for m in _ENCODE_METHODS):
        return None
    return backend


def _cut_tokens(backend: Any) -> dict[str, int]:
    """The special tokens a prompt may be cut at (the module's docstring says why these)."""
    added = backend.get_added_tokens_decoder()
    contents = [t.content for t in added.values() if t.content]
    if any("\0" in c for c in contents):
        return {}
    # one scan of all added tokens' text a candidate (some tokenizers add thousands): a
    # candidate found more often than it is itself added is inside another one
    joined = "\0".join(contents)
    out: dict[str, int] = {}
    for i, t in added.items():
        c = t.content
        if (t.special and c and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
                and joined.count(c) == contents.count(c)):
            out[c] = i
    return out
