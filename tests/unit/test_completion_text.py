"""What a completion's text and logprobs hold: a continuation keeps its first token's
leading space (as `tokenizer.decode` gives it), and logprobs list exactly the tokens
of the content returned (a stop string's tokens stay out), streamed and not.

Here over the fake actor, whose tokens are known in advance; the embedded default's answer:
tests/integration/test_completion_text.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from app_server import CHAT, COMPLETIONS, engine_factory, serve

import trio_mlx
from trio_mlx.actor import FakeActor
from trio_mlx.models import load_tokenizer


def spaced_token(model: Path) -> int:
    """A token whose text starts with a space (the tiny tokenizer's " the", say)."""
    tok = load_tokenizer(model)
    return next(t for t in range(FakeActor.first + 1, 512)
                if (s := tok.decode([t])).startswith(" ") and s.strip().isalpha())


async def test_a_completion_keeps_its_first_tokens_leading_space(tiny_model_fp32: Path) -> None:
    first = spaced_token(tiny_model_fp32)
    prompt = [first - 1]  # the fake model continues with `first`, then first + 1, ...
    async with trio_mlx.open_engine(tiny_model_fp32, actor=FakeActor) as engine:
        expected = engine.tokenizer.decode(FakeActor.continuation(prompt, 4))
        assert expected.startswith(" ")
        async with engine.generate(prompt, max_tokens=4) as events:
            text = "".join([e.text async for e in events if isinstance(e, trio_mlx.TextDelta)])
        assert text == expected
        # A chat answer still starts at its first word, as mlx_lm's detokenizer makes it.
        chat_prompt = engine.encode_prompt("chat", [{"role": "user", "content": "hi"}])
        async with engine.chat([{"role": "user", "content": "hi"}], max_tokens=4) as events:
            text = "".join([e.text async for e in events if isinstance(e, trio_mlx.TextDelta)])
        assert text == engine.tokenizer.decode(FakeActor.continuation(chat_prompt, 4)).lstrip(" ")


async def test_completions_keep_the_leading_space_streamed_and_whole(tiny_model_fp32: Path) -> None:
    first = spaced_token(tiny_model_fp32)
    body = {"prompt": [first - 1], "max_tokens": 4}
    async with serve(tiny_model_fp32, factory=engine_factory(actor=FakeActor)) as server, \
            server.client() as client:
        expected = server.engine.tokenizer.decode(FakeActor.continuation([first - 1], 4))
        whole = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
        streamed = await _stream_text(client, COMPLETIONS, {**body, "stream": True})
        assert whole == streamed == expected


async def _stream_text(client: Any, path: str, body: dict[str, Any]) -> str:
    return "".join(c["text"] for c in await _chunks(client, path, body))


async def _chunks(client: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out += json.loads(line[6:])["choices"]
    return out


def plain_run(model: Path, n: int = 8) -> int:
    """The first of `n` consecutive ids (what the fake model emits) that decode to printable ASCII."""
    tok = load_tokenizer(model)
    ok = [t >= FakeActor.first and (s := tok.decode([t])).isprintable() and s.isascii() and s.strip() != ""
          for t in range(512)]
    return next(t for t in range(FakeActor.first + 1, 512 - n) if all(ok[t : t + n]))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_logprobs_match_the_content_when_a_stop_string_ends_it(tiny_model_fp32: Path, endpoint: str) -> None:
    first = plain_run(tiny_model_fp32)
    tok = load_tokenizer(tiny_model_fp32)
    texts = [tok.decode([t]) for t in range(first, first + 8)]
    k = next(k for k in range(2, 8) if texts[k] not in "".join(texts[: k + 1])[:-1])
    path = COMPLETIONS if endpoint == "completions" else CHAT
    base: dict[str, Any] = {"max_tokens": 8, "stop": [texts[k]]}
    if endpoint == "completions":
        base |= {"prompt": [first - 1], "logprobs": 1}
    else:  # the fake model continues from the chat template's last token: bias it there
        base |= {"messages": [{"role": "user", "content": "Hello"}], "logprobs": True, "top_logprobs": 1}

    def tokens_of(choice: dict[str, Any]) -> list[str]:
        lp = choice.get("logprobs")
        if not lp:
            return []
        return lp["tokens"] if endpoint == "completions" else [t["token"] for t in lp["content"]]

    def text_of(choice: dict[str, Any]) -> str:
        if endpoint == "completions":
            return choice["text"]
        return (choice.get("message") or choice.get("delta") or {}).get("content") or ""

    async with serve(tiny_model_fp32, factory=engine_factory(actor=FakeActor)) as server, \
            server.client() as client:
        if endpoint == "chat":
            prompt = server.engine.encode_prompt("chat", base["messages"])
            texts = [tok.decode([t]) for t in FakeActor.continuation(prompt, 8)]
            k = next((k for k in range(2, 8) if texts[k].strip() and texts[k] not in "".join(texts[: k + 1])[:-1]), None)
            assert k is not None and not any("\ufffd" in t for t in texts[: k + 1]), texts
            base["stop"] = [texts[k]]
        whole = (await client.post(path, json=base)).json()["choices"][0]
        chunks = await _chunks(client, path, {**base, "stream": True})
    content = "".join(texts[:k])
    assert text_of(whole) == (content.lstrip(" ") if endpoint == "chat" else content)
    assert tokens_of(whole) == texts[:k]  # the stop string's token is not among them
    assert "".join(text_of(c) for c in chunks) == text_of(whole)
    assert [t for c in chunks for t in tokens_of(c)] == texts[:k]


async def test_logprob_bytes_rebuild_the_text_where_tokens_split_a_character(tiny_model_fp32: Path) -> None:
    """A token holding part of an emoji came back as token "�" with the bytes of U+FFFD, so the
    bytes never rebuilt the content, and completions' top_logprobs (keyed by token text) lost
    alternatives that all read "�". Now each token has its own bytes and OpenAI's `bytes:\\x..`
    text, and text_offset counts the characters the bytes complete."""
    tok = load_tokenizer(tiny_model_fp32)
    answer = "café 👩 hi"
    ids = tok.encode(answer, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # the tokenizer splits these characters
    factory = engine_factory(actor=lambda *a, **k: FakeActor(*a, reply=lambda prompt: [*ids, tok.eos_token_id], **k))
    async with serve(tiny_model_fp32, factory=factory) as server, server.client() as client:
        r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                                          "logprobs": True, "top_logprobs": 5})
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert choice["message"]["content"] == answer
        assert bytes(b for e in content for b in e["bytes"]).decode() == answer
        assert all("\ufffd" not in e["token"] for e in content), [e["token"] for e in content]
        assert any(e["token"].startswith("bytes:\\x") for e in content)
        for e in content:
            assert all(bytes(t["bytes"]).decode("utf-8", "replace") == t["token"] or t["token"].startswith("bytes:")
                       for t in e["top_logprobs"])
        r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 20, "logprobs": 5})
        lp = r.json()["choices"][0]["logprobs"]
        text = r.json()["choices"][0]["text"]
        assert text == answer
        # keyed by each token's own text (split characters' pieces all read "�", and collided)
        assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)), lp
        assert len({t for t in lp["tokens"] if t.startswith("bytes:")}) >= 4, lp["tokens"]
        # each offset is where its token's first whole character starts in the text
        starts = [text.index(w) for w in ("c", "a", "f", "é", " ", "👩", " hi")]
        assert sorted(set(lp["text_offset"])) == starts, lp["text_offset"]
