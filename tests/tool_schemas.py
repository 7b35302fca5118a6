"""The tools that the tool-calling tests offer, in one place: their parameter schemas and
OpenAI's chat tool shape; each API's tests wrap the schemas in their own shape."""

from __future__ import annotations

from typing import Any

ASK_TEXT = "What is the weather in Paris?"
ASK = [{"role": "user", "content": ASK_TEXT}]
WEATHER_DESCRIPTION = "The weather in a city"


def weather_parameters(city_max: int, *, unit: bool = False) -> dict[str, Any]:
    """get_weather's parameters: a city of at most `city_max` characters and 1-7 days (and a unit)."""
    properties: dict[str, Any] = {
        "city": {"type": "string", "maxLength": city_max},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }
    if unit:
        properties["unit"] = {"enum": ["celsius", "fahrenheit"]}
    return {"type": "object", "properties": properties, "required": ["city", "days"], "additionalProperties": False}


def search_parameters(*, closed: bool) -> dict[str, Any]:
    """search's parameters: a query of at most 12 characters (and nothing else, if `closed`)."""
    schema: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
                              "required": ["q"]}
    if closed:
        schema["additionalProperties"] = False
    return schema


def chat_tool(name: str, parameters: dict[str, Any] | None = None, description: str | None = None) -> dict[str, Any]:
    """A tool in OpenAI's chat shape."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}
