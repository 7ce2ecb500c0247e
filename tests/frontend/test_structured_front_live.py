"""Structured outputs and tool calls through the OpenAI front (``pd_ensemble`` 1P1D), with the official SDK.

Invariants: ``client.chat.completions.parse`` with a pydantic model returns a parsed instance; ``json_object``
answers are JSON objects; a tool round trip works (a forced call with ``parsed_arguments``, the tool's result sent
back, a text answer); a streamed named call arrives as ``tool_calls`` deltas with finish reason ``tool_calls``; a
schema the server cannot compile is a 400 naming ``response_format``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
MODEL = "pd_ensemble"
READY_TIMEOUT_S = 600.0  # three engines load slowly on a loaded 2-core host


class City(BaseModel):
    name: str = Field(max_length=30)
    country: Literal["France", "Italy", "Spain"]
    population_millions: int = Field(ge=0, le=50)   # a float: SmolLM2 writes digits until max_tokens


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(openai_stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_stack.openai_url, api_key="unused", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_tokens=80)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


def test_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the capital of France as a JSON object with a key "
                                                          "city."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)


def test_tool_round_trip(client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.parse(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                          temperature=0, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
    messages += [choice.message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_a_named_call_streams_as_tool_call_deltas(client: openai.OpenAI) -> None:
    tools: list[Any] = [openai.pydantic_function_tool(GetWeather),
                        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=tools, stream=True,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, temperature=0, max_tokens=80)
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                arguments += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert names == ["GetWeather"] and finish == "tool_calls"
    GetWeather.model_validate_json(arguments)


def test_a_schema_the_server_cannot_compile_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    assert e.value.body["param"] == "response_format"  # type: ignore[index]
