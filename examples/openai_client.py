"""Talk to a running trio_mlx server with the official openai SDK: one answer, then one streamed.

    bash scripts/serve.sh                      # in another terminal
    python examples/openai_client.py "What is the capital of France?"

Set OPENAI_BASE_URL (default http://127.0.0.1:8000/v1) and OPENAI_API_KEY when the
server has TRIO_MLX_API_KEY set.
"""

import os
import sys

import openai

client = openai.OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "unused"),
)
model = client.models.list().data[0].id  # the one model the server serves
messages = [{"role": "user", "content": " ".join(sys.argv[1:]) or "What is the capital of France?"}]

reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
print(reply.choices[0].message.content)
print(f"[{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens]\n")

stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, stream=True,
                                        stream_options={"include_usage": True})
for chunk in stream:
    for choice in chunk.choices:
        print(choice.delta.content or "", end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens streamed]")
