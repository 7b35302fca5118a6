"""The HTTP API's successful paths: probes, models, OpenAPI, chat and text completions (not streamed).

Here the completions, on a real model; probes, models and OpenAPI: tests/unit/test_app_api.py.
"""

from __future__ import annotations

import json

import trio
from app_server import CHAT, COMPLETIONS, HELLO, chat_body, serve


async def test_chat_completion_shape_and_usage(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        r = await client.post(CHAT, json=chat_body(max_tokens=6, ignore_eos=True, temperature=0))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert body["model"] == "model"  # derived from the model directory's name
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["logprobs"] is None
        usage = body["usage"]
        assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + 6
        # greedy is deterministic; max_completion_tokens is an alias; "model" may name the served id
        again = await client.post(CHAT, json={"messages": HELLO, "max_completion_tokens": 6, "ignore_eos": True,
                                              "temperature": 0, "model": "model"})
        assert again.json()["choices"][0]["message"] == choice["message"]


async def test_text_completion_prompt_forms(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        ids = server.engine.tokenizer.encode("The quick brown fox")
        texts = []
        for prompt in ("The quick brown fox", ["The quick brown fox"], ids, [ids]):
            r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, (prompt, r.text)
            body = r.json()
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["usage"]["completion_tokens"] == 5
            texts.append(body["choices"][0]["text"])
        assert len(set(texts)) == 1  # the same prompt however it is spelled
        # the default max_tokens of the completions API is 16
        r = await client.post(COMPLETIONS, json={"prompt": "x", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16


async def test_n_choices_run_in_the_batch_and_seeds_are_per_choice(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "n": 3, "seed": 7, "temperature": 1.0,
                "ignore_eos": True}
        submitted = server.engine.statistics().requests_submitted
        r = await client.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert server.engine.statistics().requests_submitted == submitted + 3
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        texts = [c["text"] for c in out["choices"]]
        assert len(set(texts)) == 3  # seed, seed+1, seed+2
        assert out["usage"]["completion_tokens"] == 36
        # choice i alone with seed + i gives the same text
        for i in range(3):
            one = await client.post(COMPLETIONS, json={**body, "n": 1, "seed": 7 + i})
            assert one.json()["choices"][0]["text"] == texts[i]
        # and the whole request is reproducible
        assert [c["text"] for c in (await client.post(COMPLETIONS, json=body)).json()["choices"]] == texts


async def test_logprobs_in_both_formats(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        r = await client.post(CHAT, json=chat_body(max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True))
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["content"]) == 4
        for entry in lp["content"]:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            # a token's bytes: its text's, or the `bytes:\xNN` text's (part of a character)
            token, raw = entry["token"], bytes(entry["bytes"])
            assert entry["logprob"] <= 0 and raw == (token.encode() if not token.startswith("bytes:") else
                                                     bytes.fromhex(token[6:].replace("\\x", "")))
            assert len(entry["top_logprobs"]) == 3
            assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        r = await client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 4, "logprobs": 2, "ignore_eos": True})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
        # logprobs 0: the chosen tokens' logprobs, no alternatives (OpenAI's legacy API; vLLM too),
        # streamed or not
        for stream in (False, True):
            r = await client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 4, "logprobs": 0,
                                                     "ignore_eos": True, "stream": stream})
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                got = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for t in c["choices"][0]["logprobs"]["token_logprobs"]]
            else:
                lp = r.json()["choices"][0]["logprobs"]
                assert lp is not None and lp["top_logprobs"] == [{}] * 4
                got = lp["token_logprobs"]
            assert len(got) == 4 and all(x <= 0 for x in got), r.text


async def test_stop_strings_and_concurrent_requests(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        base = (await client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 20, "temperature": 0,
                                                     "ignore_eos": True})).json()["choices"][0]["text"]
        stop = base[3:5]
        assert stop
        r = await client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 20, "temperature": 0,
                                                 "stop": [stop], "ignore_eos": True})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["text"] == base[: base.index(stop)]

        results = []

        async def one(i: int) -> None:
            resp = await client.post(COMPLETIONS, json={"prompt": f"n{i}", "max_tokens": 7, "ignore_eos": True})
            results.append(resp.json()["usage"]["completion_tokens"])

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        assert results == [7] * 16


async def test_chat_continue_final_message_continues_the_assistants_text(tiny_model_fp32):
    """vLLM's extension: the last message, the assistant's, is continued rather than answered,
    streamed or not; without an assistant message last it is a 400."""
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My pick is"}]
    async with serve(tiny_model_fp32) as server, server.client() as client:
        engine = server.engine
        prompt = engine.encode_prompt("chat", messages, {"continue_final_message": True})
        body = chat_body(messages=messages, max_tokens=5, ignore_eos=True, temperature=0, continue_final_message=True)
        r = await client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        r = await client.post(COMPLETIONS, json={"model": "model", "prompt": prompt, "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True})
        completion = r.json()["choices"][0]["text"]
        r = await client.post(CHAT, json=chat_body(max_tokens=2, continue_final_message=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "assistant" in r.json()["error"]["message"]
    assert engine.tokenizer.decode(prompt).endswith("assistant\nMy pick is")
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    assert whole["choices"][0]["message"]["content"] == completion
