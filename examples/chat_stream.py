"""Stream one chat answer from the embedded default model through the channel API.

    python examples/chat_stream.py "What is the capital of France?"
"""

import sys

import trio

import trio_mlx


async def main(question: str) -> None:
    async with trio_mlx.open_engine() as engine:  # None = the embedded SmolLM2-135M-Instruct
        messages = [{"role": "user", "content": question}]
        async with engine.chat(messages, max_tokens=128, temperature=0) as events:
            async for event in events:
                if isinstance(event, trio_mlx.TextDelta):
                    print(event.text, end="", flush=True)
                else:
                    print(f"\n[{event.finish_reason}; {event.usage.prompt_tokens} prompt + "
                          f"{event.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    trio.run(main, " ".join(sys.argv[1:]) or "What is the capital of France?")
