"""OpenAI request → sampling parameters (only what the client set; OpenAI's defaults where it did not), fields
this server cannot honour → 400 naming them, and backend responses → OpenAI bodies, chunks, usage,
logprobs."""

from __future__ import annotations

import pytest

from frontend import mapping
from frontend.errors import OpenAIError
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.wire import BackendResponse, SampleDelta, TokenLogprob, Totals

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})


def test_only_set_fields_are_sent_with_openai_defaults_for_max_tokens_and_temperature() -> None:
    assert mapping.completion_sampling(completion()) == {"max_tokens": 16, "temperature": 1.0}
    assert mapping.chat_sampling(chat(), default_max_tokens=300) == {"max_tokens": 300, "temperature": 1.0}
    neutral = completion(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, n=1, stop=[])
    assert mapping.completion_sampling(neutral) == {"max_tokens": 16, "temperature": 1.0}


def test_every_sampling_field_maps_to_its_server_key() -> None:
    params = mapping.completion_sampling(completion(
        max_tokens=8, temperature=0, top_p=0.9, stop=["\n", "."], seed=3, n=2, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"42": -100}, logprobs=2,
        top_k=5, min_p=0.1,
        min_tokens=2, ignore_eos=True, stop_token_ids=[2], include_stop_str_in_output=True))
    assert params == {"max_tokens": 8, "temperature": 0, "top_p": 0.9, "stop": ["\n", "."], "seed": 3, "n": 2,
                      "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                      "logit_bias": {"42": -100.0}, "logprobs": 2, "top_k": 5, "min_p": 0.1, "min_tokens": 2,
                      "ignore_eos": True, "stop_token_ids": [2], "include_stop_str_in_output": True}


def test_chat_max_completion_tokens_wins_and_logprobs_need_the_flag() -> None:
    assert mapping.chat_sampling(chat(max_completion_tokens=5, max_tokens=9), 100)["max_tokens"] == 5
    assert mapping.chat_sampling(chat(max_tokens=9), 100)["max_tokens"] == 9
    assert mapping.chat_sampling(chat(logprobs=True, top_logprobs=3), 100)["logprobs"] == 3
    assert mapping.chat_sampling(chat(logprobs=True), 100)["logprobs"] == 0
    assert "logprobs" not in mapping.chat_sampling(chat(logprobs=False), 100)
    with pytest.raises(OpenAIError) as e:
        mapping.chat_messages(chat(top_logprobs=2))
    assert e.value.status == 400 and e.value.param == "top_logprobs"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),   # without tools
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),   # without stream
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content"),
])
def test_chat_fields_we_cannot_honour_are_400_naming_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        req = chat(**fields)
        plan = mapping.tool_plan(req)
        mapping.chat_messages(req, plan)
        mapping.chat_sampling(req, 100, plan)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error", param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"logit_bias": {"abc": 1}}, "logit_bias")])
def test_completion_fields_we_cannot_honour_are_400_naming_the_field(
        fields: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        req = completion(**fields)
        mapping.completion_prompt(req)
        mapping.completion_sampling(req)
    assert e.value.status == 400 and e.value.param == param


def test_messages_keep_their_turns_developer_is_system_and_text_parts_join() -> None:
    req = chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"},
                         {"role": "user",
                          "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}])
    assert mapping.chat_messages(req) == [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "a"},
                                          {"role": "assistant", "content": "b"},
                                          {"role": "user", "content": "cd"}]


def _two_samples() -> Totals:
    totals = Totals(2)
    lp = TokenLogprob(1, "A", -0.5, (("A", -0.5), ("B", -1.0)))
    totals.add(BackendResponse((SampleDelta(0, "A", None, 1, (lp,)), SampleDelta(1, "", None, 0)), 4))
    totals.add(BackendResponse((SampleDelta(0, "", "stop", 0), SampleDelta(1, "xy", "length", 2)), 4, True))
    return totals


def test_usage_is_prompt_tokens_plus_the_new_tokens_of_every_choice() -> None:
    usage = mapping.usage_of(_two_samples())
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 3, 7)
    assert usage.prompt_tokens_details is None   # the server sent no num_cached_tokens


def test_usage_reports_the_prompts_cached_tokens_once_as_openai_defines_them() -> None:
    totals = Totals(2)
    totals.add(BackendResponse((SampleDelta(0, "A", None, 1, counts={"num_cached_tokens": 32}),
                                SampleDelta(1, "B", None, 1, counts={"num_cached_tokens": 32})), 40))
    last = (SampleDelta(0, "", "stop", 0, counts={"num_cached_tokens": 32}),
            SampleDelta(1, "C", "length", 1, counts={"num_cached_tokens": 32}))
    totals.add(BackendResponse(last, 40, True))
    usage = mapping.usage_of(totals)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 3, 43)
    assert usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 32}


def test_whole_answers_have_one_choice_per_sample_by_index() -> None:
    body = mapping.chat_response(_two_samples(), "id", 1, "m", top_logprobs=1)
    assert [(c.index, c.message.content,
             c.finish_reason) for c in body.choices] == [(0, "A", "stop"), (1, "xy", "length")]
    content = body.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and content[0].token == "A" and content[0].bytes == [65]
    assert [t.token for t in content[0].top_logprobs] == ["A"]          # top_k = 1 of the two sent
    plain = mapping.completion_response(_two_samples(), "id", 1, "m", want_logprobs=False)
    assert [c.text for c in plain.choices] == ["A", "xy"] and plain.choices[0].logprobs is None


def test_completion_logprobs_offsets_count_characters_across_chunks() -> None:
    tokens = [TokenLogprob(1, "He", -0.1, (("He", -0.1),)),
              TokenLogprob(2, "llo", -0.2, (("llo", -0.2), ("y", -3.0)))]
    lp = mapping.completion_logprobs(tokens, text_offset=5)
    assert lp.tokens == ["He", "llo"] and lp.token_logprobs == [-0.1, -0.2] and lp.text_offset == [5, 7]
    assert lp.top_logprobs == [{"He": -0.1}, {"llo": -0.2, "y": -3.0}]
    offsets: list[int] = []
    for piece in ("He", "llo"):
        response = BackendResponse((SampleDelta(0, piece, None, 1, tuple(tokens[:1])),))
        chunk = mapping.completion_chunk(response, "i", 1, "m", True, offsets)
        assert chunk is not None
    assert offsets == [5] and chunk.choices[0].logprobs.text_offset == [2]  # type: ignore[union-attr]


def test_chunks_carry_only_the_choices_a_response_changed() -> None:
    response = BackendResponse((SampleDelta(0, "", None, 0), SampleDelta(1, "z", None, 1)))
    chunk = mapping.chat_chunk(response, "i", 1, "m", None)
    assert chunk is not None and [(c.index, c.delta.content) for c in chunk.choices] == [(1, "z")]
    assert mapping.chat_chunk(BackendResponse((SampleDelta(0, "", None, 0),)), "i", 1, "m", None) is None
    assert mapping.chat_chunk(BackendResponse(final=True), "i", 1, "m", None) is None
    role = mapping.chat_role_chunk(2, "i", 1, "m")
    assert [(c.index, c.delta.role) for c in role.choices] == [(0, "assistant"), (1, "assistant")]
