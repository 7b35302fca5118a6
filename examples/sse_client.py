"""Read a streamed chat completion as raw server-sent events, with httpx (no SDK).

    bash scripts/serve.sh                      # in another terminal
    python examples/sse_client.py "Tell me a story"

Each event is `data: <chat.completion.chunk JSON>`; the stream ends with `data: [DONE]`.
Lines starting with ':' are keep-alive comments (sent while the request waits in the queue).
"""

import json
import os
import sys

import httpx

url = os.environ.get("TRIO_MLX_URL", "http://127.0.0.1:8000") + "/v1/chat/completions"
body = {
    "messages": [{"role": "user", "content": " ".join(sys.argv[1:]) or "Tell me a story"}],
    "max_tokens": 128,
    "stream": True,
    "stream_options": {"include_usage": True},
}
with httpx.stream("POST", url, json=body, timeout=None) as response:
    response.raise_for_status()
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue  # blank separators and ': ping' comments
        data = line[len("data: "):]
        if data == "[DONE]":
            print()
            break
        chunk = json.loads(data)
        if "error" in chunk:  # a failure after the stream started
            sys.exit(f"\nerror: {chunk['error']['message']}")
        for choice in chunk["choices"]:
            print(choice["delta"].get("content") or "", end="", flush=True)
        if chunk.get("usage"):
            print(f"\n[{chunk['usage']['completion_tokens']} tokens]", end="")
