"""A JSON-schema answer and a tool call through the channel API.

    python examples/tools_and_json.py [MODEL]

MODEL: a local MLX directory or a hub id; the default is the embedded
SmolLM2-135M-Instruct, which answers in the schema but whose chat template has
no tool calling (the tool request then shows the error a client gets). Try a
model whose template has tools, e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit.
"""

import json
import sys

import trio

import trio_mlx

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                   "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def main(model: str | None) -> None:
    async with trio_mlx.open_engine(model) as engine:
        # 1. structured output: the answer is held to the schema, token by token
        ask = [{"role": "user", "content": "Tell me about the capital of France."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
        async with engine.chat(ask, response_format=fmt, max_tokens=80, temperature=0) as events:
            text = "".join([ev.text async for ev in events if isinstance(ev, trio_mlx.TextDelta)])
        print("JSON answer:", json.loads(text))

        # 2. a tool call: "required" makes the model call one of the tools
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        try:
            async with engine.chat(ask, tools=[WEATHER], tool_choice="required", max_tokens=80,
                                   temperature=0) as events:
                async for ev in events:
                    if isinstance(ev, trio_mlx.ToolCalls):
                        for call in ev.calls:
                            print(f"tool call {call.id}: {call.name}({call.arguments})")
                    elif isinstance(ev, trio_mlx.Finished):
                        print("finish_reason:", ev.finish_reason)
        except trio_mlx.InvalidRequestError as exc:
            print(f"tools refused ({exc.param}): {exc.message}")


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
