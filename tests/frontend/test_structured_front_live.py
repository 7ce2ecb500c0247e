"""Structured outputs and tool calls through the OpenAI front (``pd_ensemble`` 1P1D), with the official SDK.

Invariants, with the bundled SmolLM2-135M at ``max_tokens`` 128 where the SDK's usual examples are run: a
tool (OpenAI's ``get_current_weather`` example, not strict) with ``tool_choice`` ``required`` or named gives
one call of it with arguments valid under its schema, finish reason ``tool_calls``, no content; with
``auto`` either such a call or a text answer, never the call object as text; ``response_format``
``json_schema`` gives JSON valid under the schema with finish reason ``stop``;
``client.chat.completions.parse`` with a pydantic model (the SDK's ``CalendarEvent`` example and a bounded
one) returns a parsed instance; ``json_object`` answers are JSON objects; a tool round trip works (a forced
call with ``parsed_arguments``, the tool's result sent back, a text answer); a streamed named call arrives
as ``tool_calls`` deltas with finish reason ``tool_calls``; a call cut short by ``max_tokens`` is
``length`` with no content and no half call, whole or streamed; a schema the server cannot compile is a 400
naming ``response_format`` or ``tools[i].function.parameters``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

jsonschema = pytest.importorskip("jsonschema")

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


class CalendarEvent(BaseModel):
    """The SDK's own ``parse`` example."""

    name: str
    date: str
    participants: list[str]


#: OpenAI's function-calling example, as most clients send it (not strict: no additionalProperties).
WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
WEATHER_QUESTION: Any = [{"role": "user", "content": "What's the weather like in Boston today?"}]
NAMED = {"type": "function", "function": {"name": "get_current_weather"}}


@pytest.fixture(scope="module")
def client(openai_stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_stack.openai_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_the_usual_tool_call_example(client: openai.OpenAI, tool_choice: Any) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                                tool_choice=tool_choice, temperature=0, max_tokens=128)
    choice = completion.choices[0]
    if tool_choice == "auto" and not choice.message.tool_calls:   # the model may answer in text
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        assert "tool_calls" not in choice.message.content
        return
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_current_weather"
    jsonschema.validate(json.loads(call.function.arguments), {**WEATHER_TOOL["function"]["parameters"],
                                                              "additionalProperties": False})


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Where is the Eiffel tower? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        temperature=0, max_tokens=128)
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), schema)


@pytest.mark.parametrize(("model", "messages"), [
    (CalendarEvent, [{"role": "system", "content": "Extract the event information."},
                     {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."}]),
    (City, [{"role": "user", "content": "Describe Paris as JSON."}]),
], ids=["calendar_event", "city"])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: type[BaseModel], messages: Any) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=messages, response_format=model,
                                               temperature=0, max_tokens=128)
    assert isinstance(completion.choices[0].message.parsed, model)
    assert completion.choices[0].finish_reason == "stop"


def test_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France as a JSON object with a key "
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
                        {"type": "function",
                         "function": {"name": "get_time", "parameters": {"type": "object"}}}]
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


def test_a_forced_call_cut_short_by_max_tokens_is_length_without_content_or_half_calls(
        client: openai.OpenAI) -> None:
    request: Any = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL],
                    "tool_choice": NAMED, "temperature": 0, "max_tokens": 8}
    choice = client.chat.completions.create(**request).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", None, None)
    deltas = [c for chunk in client.chat.completions.create(**request, stream=True) for c in chunk.choices]
    assert deltas[-1].finish_reason == "length"
    assert not any(d.delta.content or d.delta.tool_calls for d in deltas)


def test_a_schema_the_server_cannot_compile_is_a_400_naming_the_field_sent(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    body: Any = e.value.body
    assert body["param"] == "response_format"
    assert "/nowhere" in body["message"] and "sampling_parameters" not in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, tool_choice="required",
            tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "broken", "parameters": bad}}])
    body = e.value.body
    assert body["param"] == "tools[1].function.parameters"
    assert "/nowhere" in body["message"] and "sampling_parameters" not in body["message"]
