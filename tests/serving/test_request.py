"""``serving.parsing.request``: every bad input is a ``RequestError`` naming its field; good inputs parse as
the vLLM backend (and genai-perf) expect."""

from __future__ import annotations

import numpy as np
import pytest

from serving.parsing.pd_request import parse_pd_request
from serving.parsing.request import RETURN_INPUTS, GenerateRequest, OutputOptions, RequestError, parse_request


def _parse(**inputs: object) -> GenerateRequest:
    inputs.setdefault("text_input", b"Hello")
    return parse_request(inputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("inputs, field", [
    ({"text_input": b""}, "text_input"),
    ({"text_input": b"\xff\xfe"}, "text_input"),
    ({"text_input": True}, "text_input"),
    ({"sampling_parameters": b"{not json"}, "sampling_parameters"),
    ({"sampling_parameters": b"[1, 2]"}, "sampling_parameters"),
    ({"sampling_parameters": b'{"max_tokens": 8, "bogus": 1}'}, "sampling_parameters.bogus"),
    ({"sampling_parameters": b'{"max_tokens": 0}'}, "sampling_parameters.max_tokens"),
    ({"sampling_parameters": b'{"max_tokens": -3}'}, "sampling_parameters.max_tokens"),
    ({"sampling_parameters": b'{"max_tokens": "many"}'}, "sampling_parameters.max_tokens"),
    ({"sampling_parameters": b'{"max_tokens": [4]}'}, "sampling_parameters.max_tokens"),
    ({"sampling_parameters": b'{"temperature": "hot"}'}, "sampling_parameters.temperature"),
    ({"sampling_parameters": b'{"temperature": -1}'}, "sampling_parameters.temperature"),
    ({"sampling_parameters": b'{"top_p": 0}'}, "sampling_parameters.top_p"),
    ({"sampling_parameters": b'{"stop": 5}'}, "sampling_parameters.stop"),
    ({"sampling_parameters": b'{"stop_token_ids": "2"}'}, "sampling_parameters.stop_token_ids"),
    ({"sampling_parameters": b'{"ignore_eos": "maybe"}'}, "sampling_parameters.ignore_eos"),
    ({"stream": b"true"}, "stream"),
    ({"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
    ({"apply_chat_template": b"yes"}, "apply_chat_template"),
    ({"return_num_cached_tokens": b"true"}, "return_num_cached_tokens"),
    ({"image": b"..."}, "image"),
])
def test_bad_input_names_its_field(inputs: dict[str, object], field: str) -> None:
    with pytest.raises(RequestError) as info:
        _parse(**inputs)
    assert info.value.field == field
    assert field in str(info.value)


def test_each_return_input_turns_on_its_own_output_only() -> None:
    assert _parse().outputs == OutputOptions()
    for name in RETURN_INPUTS:
        asked = _parse(**{name: True}).outputs
        assert asked.names == {name.removeprefix("return_")}, name
    assert _parse(return_num_cached_tokens=True).outputs == OutputOptions.of("num_cached_tokens")


def test_missing_prompt_is_an_error() -> None:
    with pytest.raises(RequestError) as info:
        parse_request({"stream": True})
    assert info.value.field == "text_input"


def test_string_values_as_genai_perf_sends_them() -> None:
    req = _parse(sampling_parameters=b'{"max_tokens": "32", "temperature": "0", "top_p": "0.9", "top_k": '
                                     b'"5", "seed": "7", "ignore_eos": "true", "stop": "\\n", '
                                     b'"stop_token_ids": ["2"]}')
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (32, 0.0, 0.9, 5, 7)
    assert p.ignore_eos is True and p.stop == ("\n",) and p.stop_token_ids == (2,)


def test_stop_list_and_defaults() -> None:
    req = _parse(sampling_parameters=b'{"stop": ["a", "b"]}')
    assert req.params.stop == ("a", "b")
    assert _parse(sampling_parameters=b"").params == _parse().params


def test_non_streaming_echoes_prompt_by_default() -> None:
    req = _parse()
    assert not req.stream and not req.exclude_input_in_output and req.echo_prompt
    assert not _parse(exclude_input_in_output=True).echo_prompt


def test_streaming_never_echoes_the_prompt() -> None:
    req = _parse(stream=True)
    assert req.exclude_input_in_output and not req.echo_prompt
    assert not _parse(stream=True, exclude_input_in_output=True).echo_prompt


def test_text_and_flags_parse() -> None:
    req = _parse(text_input="Grüße".encode(), apply_chat_template=True, stream=False)
    assert req.prompt == "Grüße" and req.apply_chat_template


@pytest.mark.parametrize("resume, extra, why", [
    (np.array([], dtype=np.int32), {}, "non-empty"),
    (np.array([[1, 2]], dtype=np.int32), {}, "non-empty"),
    (np.array([1.5]), {}, "non-empty"),
    (np.array([-1], dtype=np.int32), {}, ">= 0"),
    (np.arange(16, dtype=np.int32), {}, "leave none"),
    (np.array([3], dtype=np.int32), {"prefill_instance": np.array([b"p@h:1"], dtype=np.object_),
                                     "prefill_rendezvous": np.array([b"http://p:1"], dtype=np.object_)},
     "direct decode"),
])
def test_bad_resume_token_ids_name_the_input(resume: np.ndarray, extra: dict, why: str) -> None:
    pd_inputs = {"bootstrap_room": np.array([7], dtype=np.int64), "resume_token_ids": resume, **extra}
    with pytest.raises(RequestError, match=f"resume_token_ids.*{why}"):
        parse_pd_request({"text_input": b"Hi", "sampling_parameters": b'{"max_tokens": 16}'}, pd_inputs)


def test_resume_token_ids_make_a_direct_decode_that_resumes() -> None:
    pd = parse_pd_request({"text_input": b"Hi", "sampling_parameters": b'{"max_tokens": 16}'},
                          {"bootstrap_room": np.array([7], dtype=np.int64),
                           "resume_token_ids": np.array([4, 5], dtype=np.int32)})
    assert pd.direct and pd.resume_token_ids == (4, 5)


def test_prompt_token_ids_come_with_their_tokenizers_fingerprint() -> None:
    llm = {"text_input": b"Hi", "sampling_parameters": b'{"max_tokens": 16}'}
    room = {"bootstrap_room": np.array([7], dtype=np.int64)}
    pd = parse_pd_request(llm, {**room, "prompt_token_ids": np.array([4, 5, 6], dtype=np.int32),
                                "tokenizer_id": np.array([b"e30de48b8f22726a"], dtype=np.object_)})
    assert pd.prompt_token_ids == (4, 5, 6) and pd.tokenizer_id == "e30de48b8f22726a"
    with pytest.raises(RequestError, match="tokenizer_id.*required"):
        parse_pd_request(llm, {**room, "prompt_token_ids": np.array([4], dtype=np.int32)})
    with pytest.raises(RequestError, match="prompt_token_ids.*>= 0"):
        parse_pd_request(llm, {**room, "prompt_token_ids": np.array([-4], dtype=np.int32),
                               "tokenizer_id": np.array([b"x"], dtype=np.object_)})
    assert parse_pd_request(llm, room).prompt_token_ids == ()


def test_dp_rank_is_one_integer_at_least_0_and_absent_means_the_instance_places_the_request() -> None:
    llm = {"text_input": b"Hi", "sampling_parameters": b'{"max_tokens": 16}'}
    room = {"bootstrap_room": np.array([7], dtype=np.int64)}
    assert parse_pd_request(llm, room).dp_rank is None
    assert parse_pd_request(llm, {**room, "dp_rank": np.array([1], dtype=np.int32)}).dp_rank == 1
    for bad in (np.array([-1], dtype=np.int32), np.array([0, 1], dtype=np.int32), np.array([1.0]),
                np.array([b"1"], dtype=np.object_)):
        with pytest.raises(RequestError, match="invalid input 'dp_rank': must be one integer >= 0"):
            parse_pd_request(llm, {**room, "dp_rank": bad})
