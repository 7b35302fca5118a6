"""A chat prompt extending a recent one is tokenized only past it, to the same ids
(engine/_prefix_tokens.py): with the embedded default's byte-level BPE, with Metaspace
tokenizers (whose first stretch is treated apart), through the chat encoder and the
engine, from several threads at once; and a tokenizer it cannot serve keeps the plain path.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from trio_mlx import models as trio_models
from trio_mlx.engine._prefix_tokens import PrefixTokens
from trio_mlx.engine._prompt import ChatEncoder
from trio_mlx.models._models import CHATML_TEMPLATE

pytestmark = pytest.mark.timeout(120)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Texts that sit at a cut: spaces and newlines either side of a special token, a special
# token's text broken up, characters outside ASCII and outside the BMP.
TRICKY = ["", " ", "\n", "  \n\n", " lead", "trail ", "ü<|im", "|>x", "é 😀", "<|im_start", "\t"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6))) for _ in range(n))


def _metaspace_tokenizer(scheme: str, lstrip_end: bool = False) -> PreTrainedTokenizerFast:
    """A small SentencePiece-like BPE (Metaspace, `prepend_scheme` as given) with ChatML's
    special tokens, trained here on random words."""
    tk = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tk.decoder = decoders.Metaspace(prepend_scheme=scheme)
    rng = random.Random(0)
    corpus = [_words(rng, 30) + " ü é \n x" for _ in range(200)]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS[:1]))
    tk.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                           AddedToken("<|im_end|>", special=True, normalized=False, lstrip=lstrip_end)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=CHATML_TEMPLATE,
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")


def _naive(hf: Any, messages: list[dict[str, str]]) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(hf.encode(text, add_special_tokens=False))


def _conversation_turns(hf: Any, enc: ChatEncoder, seed: int, turns: int = 8) -> PrefixTokens:
    """A few conversations on a shared system prompt, turn by turn, each prompt's ids
    checked against tokenizing it whole."""
    rng = random.Random(seed)
    system = _words(rng, 300)
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(3)]
    for _ in range(turns):
        for msgs in convs:
            msgs.append({"role": "user", "content": rng.choice(TRICKY) + _words(rng, 8) + rng.choice(TRICKY)})
            assert enc.encode(msgs, None) == _naive(hf, msgs)
            msgs.append({"role": "assistant", "content": rng.choice(TRICKY) + _words(rng, 5) + rng.choice(TRICKY)})
    return enc.prefix


@pytest.fixture(scope="module")
def embedded_tok(embedded_model: Path) -> Any:
    return trio_models.load_tokenizer(embedded_model)


def test_the_embedded_tokenizer_reuses_turns_and_gets_the_same_ids(embedded_tok: Any) -> None:
    enc = ChatEncoder(embedded_tok)
    assert enc.prefix.usable
    prefix = _conversation_turns(embedded_tok._tokenizer, enc, seed=1)
    # every turn after a conversation's first reused its history
    assert prefix.hits >= 3 * 7
    assert prefix.reused_tokens > 3 * 7 * 300


@pytest.mark.parametrize("scheme", ["first", "always", "never"])
def test_metaspace_tokenizers_get_the_same_ids(scheme: str) -> None:
    hf = _metaspace_tokenizer(scheme)
    enc = ChatEncoder(TokenizerWrapper(hf))
    assert enc.prefix.usable
    prefix = _conversation_turns(hf, enc, seed=2)
    assert prefix.hits >= 3 * 7


def test_a_special_token_that_strips_whitespace_is_no_cut() -> None:
    hf = _metaspace_tokenizer("first", lstrip_end=True)
    prefix = PrefixTokens(hf)
    assert "<|im_end|>" not in prefix._cut_ids and "<|im_start|>" in prefix._cut_ids
    _conversation_turns(hf, ChatEncoder(TokenizerWrapper(hf)), seed=3, turns=4)


def test_a_special_token_inside_another_added_token_is_no_cut() -> None:
    hf = _metaspace_tokenizer("first")
    hf.add_tokens([AddedToken("x<|im_start|>", special=False, normalized=False)])
    prefix = PrefixTokens(hf)
    assert "<|im_start|>" not in prefix._cut_ids and "<|im_end|>" in prefix._cut_ids


def test_a_tokenizer_that_preprocesses_text_keeps_the_plain_path(embedded_tok: Any) -> None:
    class Shouting(type(embedded_tok._tokenizer)):  # type: ignore[misc]
        def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return super().encode(text.upper() if isinstance(text, str) else text, *args, **kwargs)

    hf = embedded_tok._tokenizer
    shouting = Shouting(tokenizer_object=hf._tokenizer, chat_template=hf.chat_template)
    assert not PrefixTokens(shouting).usable
    assert PrefixTokens(shouting).encode("<|im_start|>user\nhi<|im_end|>") is None
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatEncoder(TokenizerWrapper(shouting)).encode(msgs, None) == _naive(shouting, msgs)


def test_entries_are_bounded_by_their_characters(embedded_tok: Any) -> None:
    hf = embedded_tok._tokenizer
    prefix = PrefixTokens(hf, max_chars=20_000)
    rng = random.Random(4)
    for _ in range(30):
        text = f"<|im_start|>user\n{_words(rng, 400)}<|im_end|>\n<|im_start|>assistant\n"
        assert prefix.encode(text) == list(hf.encode(text, add_special_tokens=False))
    assert 0 < prefix._chars <= 20_000
    assert sum(len(e.text) for e in prefix._entries.values()) == prefix._chars
    assert set(prefix._index.values()) <= set(prefix._entries)


def test_an_extended_entry_gives_way_to_the_one_extending_it(embedded_tok: Any) -> None:
    hf = embedded_tok._tokenizer
    prefix = PrefixTokens(hf)
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    longer = text + "<|im_start|>assistant\nhello<|im_end|>\n"
    prefix.encode(text)
    prefix.encode(longer)
    assert [e.text for e in prefix._entries.values()] == [longer]
    assert prefix.hits == 1


def test_many_threads_at_once_get_the_same_ids(embedded_tok: Any) -> None:
    hf = embedded_tok._tokenizer
    enc = ChatEncoder(embedded_tok)
    rng = random.Random(5)
    system = _words(rng, 2000)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": _words(rng, 20)}]
             for _ in range(8)]
    want = [_naive(hf, m) for m in chats]
    wrong: list[int] = []

    def run(i: int) -> None:
        for _ in range(10):
            if enc.encode(chats[i], None) != want[i]:
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert enc.prefix.hits > 0
