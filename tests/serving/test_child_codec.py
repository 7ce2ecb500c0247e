"""``serving.child.codec``: the child protocol's one schema, held to the model configs and to both encoders;
the schema check; a response round trip, errors and their kind included."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from engine.outputs import TokenLogprob
from serving.child.codec import (
    CHILD_INPUTS,
    CHILD_OUTPUTS,
    SCHEMA_HASH,
    SCHEMA_INPUT,
    ChildSchemaMismatch,
    check_schema,
    decode_response,
    encode_response,
)
from serving.delta import Delta, ErrorKind
from serving.parsing.pd_request import parse_pd_request
from serving.router.fleet import Target
from serving.router.launch import ChildCall, child_arrays
from serving.schema import config_outputs

ROOT = Path(__file__).resolve().parents[2]
#: numpy dtype kind of each Triton data type the protocol uses
NUMPY_OF = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT64": np.int64, "TYPE_INT32": np.int32,
            "TYPE_UINT8": np.uint8, "TYPE_FP32": np.float32}


def declared_inputs(role: str) -> dict[str, str]:
    """``{name: data_type}`` of the ``input`` section of ``model_repository/<role>/config.pbtxt``."""
    text = (ROOT / "model_repository" / role / "config.pbtxt").read_text()
    body = re.search(r"^input \[(.*?)^\]", text, re.S | re.M)
    assert body is not None
    return dict(re.findall(r'name: "(\w+)", data_type: (TYPE_\w+)', body.group(1)))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_child_config_declares_the_schema(role: str) -> None:
    """The inputs in config.pbtxt; the outputs as the model's auto-complete declares them
    (``serving.schema.config_outputs``, held to model.py by ``test_response_schema.py``)."""
    inputs = declared_inputs(role)
    for name, (data_type, roles) in CHILD_INPUTS.items():
        if role in roles:
            assert inputs.get(name) == data_type, (role, name)
    assert {e["name"]: e["data_type"] for e in config_outputs(role)} == CHILD_OUTPUTS


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_routers_encoder_sends_only_schema_inputs_in_their_types(role: str) -> None:
    target = Target(f"{role[0]}0@h:1", role, "127.0.0.1:8001", role, rendezvous_url="http://p0:1", dp_rank=1)
    call = ChildCall(role, target, 5, "p0@h:1" if role == "decode" else "",
                     "http://p0:1" if role == "decode" else "",
                     {"text_input": "hi", "sampling_parameters": "{}", "apply_chat_template": True},
                     prompt_token_ids=(1, 2), tokenizer_id="abc")
    arrays = child_arrays(call)
    assert arrays[SCHEMA_INPUT].tolist() == [SCHEMA_HASH.encode()] and arrays["dp_rank"].tolist() == [1]
    for name, array in arrays.items():
        data_type, roles = CHILD_INPUTS[name]
        assert role in roles and array.dtype == NUMPY_OF[data_type], name


def test_the_childs_encoder_answers_schema_outputs_in_their_types_and_leaves_out_defaults() -> None:
    entry = TokenLogprob(7, -0.5, 1, "x", ())
    full = encode_response(Delta(text="x", finish_reason="stop", num_input_tokens=3, num_output_tokens=2,
                                 num_new_tokens=1, cumulative_logprob=-0.5, logprobs=(entry,),
                                 num_cached_tokens=16,
                                 token_ids=(7,)))
    failed = encode_response(Delta.failure("bad", ErrorKind.REQUEST))
    assert {name: array.dtype for name, array in {**full, **failed}.items()} == \
        {name: np.dtype(NUMPY_OF[t]) for name, t in CHILD_OUTPUTS.items()}
    # a streamed token: its text, its count and its id; what is absent decodes to its default
    token = encode_response(Delta(text=" y", num_input_tokens=0, num_output_tokens=5, num_new_tokens=1,
                                  token_ids=(9,)))
    assert sorted(token) == ["num_output_tokens", "output_token_ids", "text_output"]
    assert decode_response(token, final=False) == Delta(text=" y", num_input_tokens=0, num_output_tokens=5,
                                                        num_new_tokens=0, token_ids=(9,))
    assert sorted(encode_response(Delta(text=""))) == ["num_output_tokens", "text_output"]


def test_a_response_round_trips_and_an_error_keeps_its_kind() -> None:
    entry = TokenLogprob(7, -0.5, 1, "é", ((8, -1.0, "b"),))
    sent = Delta(text="é", finish_reason="length", num_input_tokens=3, num_output_tokens=2, num_new_tokens=1,
                 cumulative_logprob=-0.5, logprobs=(entry,), num_cached_tokens=16, token_ids=(7,))
    got = decode_response(encode_response(sent), final=True)
    assert (got.text, got.finish_reason, got.num_input_tokens, got.num_output_tokens, got.cumulative_logprob,
            got.logprobs, got.num_cached_tokens, got.token_ids, got.final, got.error) == \
        ("é", "length", 3, 2, -0.5, (entry,), 16, (7,), True, None)
    for kind in (ErrorKind.REQUEST, ErrorKind.INSTANCE):
        failed = decode_response(encode_response(Delta.failure("bad", kind)), final=True)
        assert failed.error == "bad" and failed.error_kind is kind and failed.final
    # UNREACHABLE is the router's own finding: a child claiming it is read as the instance's error
    claimed = decode_response(encode_response(Delta.failure("bad", ErrorKind.UNREACHABLE)), final=True)
    assert claimed.error_kind is ErrorKind.INSTANCE
    # an older child's error (no error_kind) is the instance's: the router may try another
    old_error = decode_response({"error": np.frombuffer(b"x", np.uint8)}, final=True)
    assert old_error.error_kind is ErrorKind.INSTANCE


def test_another_builds_schema_is_refused_by_name_and_an_absent_one_is_not_checked() -> None:
    llm = {"text_input": b"hi"}
    room = {"bootstrap_room": np.array([5], dtype=np.int64)}
    assert parse_pd_request(llm, room).room == 5   # a client's or a test's request: nothing to check
    assert parse_pd_request(llm,
                            {**room, SCHEMA_INPUT: np.array([SCHEMA_HASH.encode()], np.object_)}).room == 5
    with pytest.raises(ChildSchemaMismatch, match=f"'0123456789ab'.*'{SCHEMA_HASH}'"):
        parse_pd_request(llm, {**room, SCHEMA_INPUT: np.array([b"0123456789ab"], np.object_)})
    with pytest.raises(ChildSchemaMismatch):
        check_schema({SCHEMA_INPUT: np.array([], np.object_)})
