"""``serving.triton.io``: numpy halves of the tensor conversions (the pb_utils halves run in the live
test)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.outputs import TokenLogprob
from serving.child.codec import decode_response, encode_response, logprobs_from_wire, logprobs_to_wire
from serving.delta import Delta, ResponseChunk
from serving.parsing.request import OutputOptions, RequestError, parse_request
from serving.schema import CLIENT_OUTPUTS
from serving.triton.io import logprobs_json, response_arrays, scalars_from_arrays

ALL = OutputOptions(frozenset(CLIENT_OUTPUTS))


def test_inputs_as_triton_hands_them_over() -> None:
    arrays = {
        "text_input": np.array([b"Hello"], dtype=np.object_),
        "stream": np.array([True]),
        "sampling_parameters": np.array([[b'{"max_tokens": "4"}']], dtype=np.object_),
        "exclude_input_in_output": np.array([np.bool_(True)]),
    }
    values = scalars_from_arrays(arrays)
    assert values == {"text_input": b"Hello", "stream": True, "sampling_parameters": b'{"max_tokens": "4"}',
                      "exclude_input_in_output": True}
    assert type(values["stream"]) is bool
    req = parse_request(values)
    assert req.stream and req.params.max_tokens == 4


@pytest.mark.parametrize("arrays, field", [
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input"),
    ({"text_input": np.array([], dtype=np.object_)}, "text_input"),
    ({"stream": np.array([1.5])}, "stream"),
])
def test_bad_tensors_name_the_input(arrays: dict[str, np.ndarray], field: str) -> None:
    with pytest.raises(RequestError) as info:
        scalars_from_arrays(arrays)
    assert info.value.field == field


def test_response_arrays_hold_only_what_was_asked() -> None:
    chunk = ResponseChunk.single(text="héllo", finish_reason="stop", num_input_tokens=7, num_output_tokens=3,
                                 num_new_tokens=2, cumulative_logprob=-1.5)
    arrays = response_arrays(chunk)
    assert list(arrays) == ["text_output"]
    assert arrays["text_output"].dtype == np.object_ and arrays["text_output"][0].decode() == "héllo"
    arrays = response_arrays(chunk, ALL)
    assert arrays["finish_reason"].tolist() == [b"stop"]
    assert arrays["cumulative_logprob"].dtype == np.float32
    assert arrays["cumulative_logprob"].tolist() == [-1.5]
    assert arrays["num_input_tokens"].dtype == np.uint32 and arrays["num_input_tokens"].tolist() == [7]
    assert arrays["num_output_tokens"].dtype == np.uint32 and arrays["num_output_tokens"].tolist() == [2]
    assert arrays["logprobs"].tolist() == [b"null"]
    assert response_arrays(ResponseChunk.single(text="x"), ALL)["finish_reason"].tolist() == [b"None"]
    only = response_arrays(chunk, OutputOptions.of("num_input_tokens"))
    assert sorted(only) == ["num_input_tokens", "text_output"]


def test_num_cached_tokens_is_per_sample_uint32_and_only_when_asked() -> None:
    chunk = ResponseChunk((Delta(text="a", num_input_tokens=40, num_output_tokens=1, num_new_tokens=1,
                                 num_cached_tokens=32),
                           Delta(text="", num_input_tokens=40)))
    assert "num_cached_tokens" not in response_arrays(chunk, OutputOptions.of("num_input_tokens"))
    arrays = response_arrays(chunk, OutputOptions.of("num_cached_tokens"))
    assert sorted(arrays) == ["num_cached_tokens", "text_output"]
    assert arrays["num_cached_tokens"].dtype == np.uint32 and arrays["num_cached_tokens"].tolist() == [32, 0]


def test_one_entry_per_sample() -> None:
    chunk = ResponseChunk((Delta(text="a", num_input_tokens=5, num_output_tokens=1, num_new_tokens=1),
                           Delta(text="", finish_reason="length", num_input_tokens=5, num_output_tokens=4)))
    arrays = response_arrays(chunk, ALL)
    assert arrays["text_output"].tolist() == [b"a", b""]
    assert arrays["finish_reason"].tolist() == [b"None", b"length"]
    assert arrays["num_output_tokens"].tolist() == [1, 0] and arrays["num_input_tokens"].tolist() == [5]


ENTRIES = (TokenLogprob(5, -0.1, 1, " the", ((5, -0.1, " the"), (9, -2.5, " a"))),
           TokenLogprob(7, -3.0, 3, "", ((2, -0.5, "x"), (5, -1.0, " the"))))


def test_logprobs_json_is_the_vllm_layout() -> None:
    tokens = json.loads(logprobs_json(ENTRIES))
    assert tokens[0] == {"5": {"logprob": -0.1, "rank": 1, "decoded_token": " the"},
                         "9": {"logprob": -2.5, "rank": 2, "decoded_token": " a"}}
    assert list(tokens[1]) == ["7", "2", "5"]   # the sampled token first, then the top ones
    assert [v["rank"] for v in tokens[1].values()] == [3, 1, 2]
    assert logprobs_json(None) == "null" and logprobs_json(()) == "[]"


def test_child_layout_round_trips_logprobs() -> None:
    assert logprobs_from_wire(logprobs_to_wire(ENTRIES)) == ENTRIES
    assert logprobs_from_wire(logprobs_to_wire(None)) is None
    arrays = encode_response(Delta(text="é", num_input_tokens=3, num_output_tokens=1, num_new_tokens=1,
                                   cumulative_logprob=-0.25, logprobs=ENTRIES[:1]))
    assert arrays["text_output"].dtype == np.uint8 and arrays["text_output"].tobytes().decode() == "é"
    assert arrays["cumulative_logprob"].tolist() == [-0.25]
    assert "num_cached_tokens" not in arrays   # 0: left out, and decoded as 0
    assert decode_response(arrays, final=False).num_cached_tokens == 0
    cached = encode_response(Delta(text="x", num_input_tokens=40, num_output_tokens=1, num_new_tokens=1,
                                   num_cached_tokens=32))
    assert cached["num_cached_tokens"].tolist() == [32] and cached["num_input_tokens"].tolist() == [40]
    assert logprobs_from_wire(arrays["logprobs"].tobytes().decode()) == ENTRIES[:1]
    with pytest.raises(ValueError):
        logprobs_from_wire("[[1, 2]]")


def test_parameters_stand_in_for_sampling_parameters() -> None:
    req = parse_request({"text_input": b"x"}, {"max_tokens": "5", "temperature": 0, "triton_enable_x": True})
    assert req.params.max_tokens == 5 and req.params.temperature == 0.0
    assert "triton_enable_x" not in req.sampling
    tensor = parse_request({"text_input": b"x", "sampling_parameters": b'{"max_tokens": 3}'},
                           {"max_tokens": 9})
    assert tensor.params.max_tokens == 3
    with pytest.raises(RequestError, match="sampling_parameters.bogus"):
        parse_request({"text_input": b"x"}, {"bogus": 1})


def test_return_inputs_select_outputs() -> None:
    req = parse_request({"text_input": b"x", "return_logprobs": True, "return_num_output_tokens": False})
    assert req.outputs == OutputOptions.of("logprobs")
    req = parse_request({"text_input": b"x", "return_num_cached_tokens": True})
    assert req.outputs == OutputOptions.of("num_cached_tokens")


def test_child_token_ids_round_trip_as_int32_and_resume_ids_travel_to_decode_only() -> None:
    from serving.router.fleet import Target
    from serving.router.launch import ChildCall, child_arrays

    arrays = encode_response(Delta(text="ab", num_input_tokens=3, num_output_tokens=4, num_new_tokens=2,
                                   token_ids=(7, 9)))
    assert arrays["output_token_ids"].dtype == np.int32 and arrays["output_token_ids"].tolist() == [7, 9]
    assert decode_response(arrays, final=False).token_ids == (7, 9)
    assert decode_response(encode_response(Delta(text="")), final=True).token_ids == ()
    target = Target("d0@h:1", "decode", "127.0.0.1:8001", "decode", rendezvous_url="http://d0:1")
    call = ChildCall("decode", target, 5, "", "", {"text_input": "hi"}, resume_token_ids=(4, 5, 6))
    sent = child_arrays(call)
    assert sent["resume_token_ids"].dtype == np.int32 and sent["resume_token_ids"].tolist() == [4, 5, 6]
    assert "resume_token_ids" not in child_arrays(ChildCall("decode", target, 5, "", "",
                                                            {"text_input": "hi"}))
