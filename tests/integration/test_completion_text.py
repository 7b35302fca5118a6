"""What a completion's text and logprobs hold: a continuation keeps its first token's
leading space (as `tokenizer.decode` gives it), and logprobs list exactly the tokens
of the content returned (a stop string's tokens stay out), streamed and not.

Here the embedded default's answer; over the fake actor: tests/unit/test_completion_text.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from app_server import COMPLETIONS, serve
from unit.test_completion_text import _chunks


@pytest.mark.slow
async def test_the_embedded_default_continues_with_a_space_and_stops_at_the_newline(embedded_model: Path) -> None:
    # The case as found: " Paris" came back as "Paris", and logprobs listed the "\n" that stop removed.
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
            "stop": ["\n"], "logprobs": 1}
    async with serve(embedded_model) as server, server.client(timeout=60) as client:
        whole = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]
        chunks = await _chunks(client, COMPLETIONS, {**body, "stream": True})
    assert whole["text"].startswith(" Paris") and "\n" not in whole["text"]
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks if c.get("logprobs") for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
