"""Structured outputs and tool calls in the front (no server): response_format and forced tool calls become
``structured_outputs`` (compact JSON unless ``whitespace`` is flexible; objects closed to their properties; a
named function or ``parallel_tool_calls: false`` allows one call); tools are described in the system message;
answers that are calls come back in OpenAI's ``tool_calls`` shape, whole or streamed; a call cut short keeps
only its complete calls and its finish reason, never the call object as content; other answers stay content;
a schema that does not compile is a 400 naming the field the client sent."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from frontend import mapping
from frontend.errors import OpenAIError
from frontend.protocol import ChatCompletionRequest
from frontend.tool_stream import ToolCallStream
from frontend.wire import BackendResponse, SampleDelta, Totals

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def constraint(req: ChatCompletionRequest) -> object:
    return mapping.chat_sampling(req, 100, mapping.tool_plan(req)).get("structured_outputs")


def test_response_format_maps_to_compact_structured_outputs_with_closed_objects() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert constraint(chat()) is None
    assert constraint(chat(response_format={"type": "text"})) is None
    assert constraint(chat(response_format={"type": "json_object"})) == {"json_object": True,
                                                                         "disable_any_whitespace": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    closed = {**schema, "additionalProperties": False}
    assert constraint(chat(response_format=fmt)) == {"json": closed, "disable_any_whitespace": True}
    assert constraint(chat(response_format=fmt, whitespace="flexible")) == {"json": closed}
    assert constraint(chat(tools=[WEATHER], tool_choice="required", whitespace="flexible")).keys() == {"json"}
    assert constraint(chat(tools=[WEATHER], tool_choice="required"))["disable_any_whitespace"] is True
    with pytest.raises(ValidationError):
        chat(whitespace="pretty")


def test_auto_describes_tools_without_constraining_and_none_leaves_them_out() -> None:
    req = chat(tools=[WEATHER])
    messages = mapping.chat_messages(req, mapping.tool_plan(req))
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"] and constraint(
        req) is None
    req = chat(tools=[WEATHER], tool_choice="none")
    assert mapping.chat_messages(req, mapping.tool_plan(req)) == USER and constraint(req) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_calls_of_declared_tools(parallel: bool) -> None:
    schema = constraint(chat(tools=[WEATHER, TIME], tool_choice="required",
                             parallel_tool_calls=parallel))["json"]
    one = {"name": "get_weather", "arguments": {"city": "Paris"}}
    jsonschema.validate({"tool_calls": [one]}, schema)
    for bad in ({"tool_calls": []}, {"tool_calls": [{"name": "nope", "arguments": {}}]},
                {"tool_calls": [{**one, "description": "x"}]},
                {"tool_calls": [{"name": "get_weather", "arguments": {"unit": "c"}}]},
                # arguments hold only the properties the tool lists (the model copied the schema into them)
                {"tool_calls": [{"name": "get_weather", "arguments": {"city": "P", "type": "x"}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    two = {"tool_calls": [one, {"name": "get_time", "arguments": {}}]}
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_named_function_allows_exactly_one_call_of_it() -> None:
    req = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    schema = constraint(req)["json"]
    one = {"name": "get_time", "arguments": {}}
    jsonschema.validate({"tool_calls": [one]}, schema)
    other = {"name": "get_weather", "arguments": {"city": "x"}}
    for bad in ({"tool_calls": [other]}, {"tool_calls": [one, one]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(OpenAIError) as e:
        mapping.tool_plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}))
    assert e.value.param == "tool_choice"


def test_a_forced_call_with_a_response_format_is_refused() -> None:
    with pytest.raises(OpenAIError) as e:
        constraint(chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}))
    assert e.value.param == "response_format"


def test_history_with_calls_and_results_renders_as_text() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]})
    messages = mapping.chat_messages(req, mapping.tool_plan(req))
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}]}
    assert messages[3] == {"role": "tool", "content": "18 C"}


def totals_of(text: str) -> Totals:
    totals = Totals(1)
    totals.add(BackendResponse((SampleDelta(0, text, "stop", 3),), 5, True))
    return totals


def test_an_answer_that_is_a_call_becomes_tool_calls_else_content() -> None:
    plan = mapping.tool_plan(chat(tools=[WEATHER]))
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    choice = mapping.chat_response(totals_of(text), "id", 0, "m", None, plan).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    for text in ("It is sunny.", '{"tool_calls": [{"name": "undeclared", "arguments": {}}]}'):
        choice = mapping.chat_response(totals_of(text), "id", 0, "m", None, plan).choices[0]
        assert (choice.message.content, choice.finish_reason,
                choice.message.tool_calls) == (text, "stop", None)


def stream(plan, pieces: list[str], finish: str = "stop") -> list:
    calls = ToolCallStream(plan)
    out = []
    for i, piece in enumerate(pieces):
        final = finish if i == len(pieces) - 1 else None
        chunk = mapping.chat_chunk(BackendResponse((SampleDelta(0, piece, final, 1),)), "id", 0, "m",
                                   None, calls)
        out.extend(chunk.choices if chunk else [])
    return out


def test_streamed_calls_are_held_then_sent_as_one_delta() -> None:
    plan = mapping.tool_plan(chat(tools=[WEATHER]))
    choices = stream(plan,
                     ['{"tool_', 'calls": [{"name": "get_weather", ', '"arguments": {"city": "Rome"}}]}'])
    assert len(choices) == 1 and choices[0].finish_reason == "tool_calls" and choices[0].delta.content is None
    (call,) = choices[0].delta.tool_calls
    assert call.index == 0 and call.function.name == "get_weather"


def test_streamed_text_flows_at_once_and_a_non_call_object_comes_out_whole() -> None:
    plan = mapping.tool_plan(chat(tools=[WEATHER]))
    choices = stream(plan, [" ", "Hello", " there"])
    assert [c.delta.content for c in choices] == [" Hello", " there"] and choices[-1].finish_reason == "stop"
    choices = stream(plan, ['{"a"', ': 1}'])
    assert [c.delta.content for c in choices] == ['{"a": 1}']


def cut_short(text: str, plan):
    """The whole answer of one choice whose ``text`` ended by ``max_tokens``."""
    totals = Totals(1)
    totals.add(BackendResponse((SampleDelta(0, text, "length", 30),), 5, True))
    choice = mapping.chat_response(totals, "id", 0, "m", None, plan).choices[0]
    assert choice.finish_reason == "length"
    return choice


@pytest.mark.parametrize("parallel", [None, False])
def test_a_call_cut_short_keeps_its_complete_calls_and_finish_reason(parallel: bool | None) -> None:
    req = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    plan = mapping.tool_plan(req)
    whole = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    for text, names in [('{"tool_', []), ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"P', []),
                        ('{"tool_calls":[' + whole + ',{"name":"get_time","argu', ["get_weather"]),
                        ('{"tool_calls":[' + whole + ']', ["get_weather"])]:
        choice = cut_short(text, plan)
        assert choice.finish_reason == "length" and choice.message.content is None, text
        assert [c.function.name for c in choice.message.tool_calls or []] == names, text
        if names:
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        streamed = stream(plan, [text[:7], text[7:]], finish="length")
        assert [c.delta.content for c in streamed] == [None] and streamed[-1].finish_reason == "length"
        assert [c.function.name for c in streamed[-1].delta.tool_calls or []] == names


def test_auto_text_that_is_not_a_call_prefix_stays_content_even_when_cut() -> None:
    plan = mapping.tool_plan(chat(tools=[WEATHER]))
    undeclared = '{"tool_calls": [{"name": "undeclared", "arguments": {}}]}'
    for text in ("The weather in Paris is", '{"city": "Par', undeclared):
        message = cut_short(text, plan).message
        assert (message.content, message.tool_calls) == (text, None)
    cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_'
    message = cut_short(cut, plan).message
    assert message.content is None and [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field_the_client_sent() -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    with pytest.raises(OpenAIError) as e:
        constraint(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}))
    assert (e.value.status, e.value.param) == (400, "response_format")
    assert e.value.message.startswith("response_format.json_schema.schema: ")
    assert "/nowhere" in e.value.message
    tool = {"type": "function", "function": {"name": "broken", "parameters": bad}}
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        with pytest.raises(OpenAIError) as e:
            constraint(chat(tools=[WEATHER, tool], tool_choice=choice))
        assert (e.value.status, e.value.param) == (400, "tools[1].function.parameters")
        assert "sampling_parameters" not in e.value.message and "/nowhere" in e.value.message
    # not compiled where nothing is forced: a named call of another function, auto
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert constraint(chat(tools=[WEATHER, tool], tool_choice=named))
    assert constraint(chat(tools=[WEATHER, tool])) is None
