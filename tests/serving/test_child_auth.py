"""Child request signatures (``signing.sign_call`` / ``verify_call``, ``inputs_digest``) and the worker's
check (``serving.workers.child_auth.ChildAuth``).

Invariants: a signature admits exactly the request it was made for, at the instance it was made for, once,
within 30 s: another prompt, another input, another target instance, another request id, another model, an old
timestamp or a second use is refused, naming the reason; the digest of one request is the same from the
router's arrays (``child_arrays``), from the wire as a worker endpoint reads it (``request_arrays``) and from
the python backend's input tensors (``pd_model.read_child_inputs``); the router puts its signature where each
path reads it (the ``pd_fleet_auth`` parameter through tritonserver); without a secret nothing is checked.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from bootstrap.auth import AuthError
from serving.child.signing import AUTH_PARAMETER, ChildUnauthenticated, inputs_digest, sign_call, verify_call
from serving.router.fleet import Target
from serving.router.launch import ChildCall, child_arrays, child_request, child_request_id, sign_child
from serving.workers.child_auth import NO_AUTH, ChildAuth
from serving.workers.endpoint import request_arrays

SECRET = b"fleet-secret"
DECODE = "decode@10.0.0.2:8001"
PREFILL = "prefill@10.0.0.1:8001"


def call(role: str = "decode", instance: str = DECODE, prompt: bytes = b"What is 2+2?", room: int = 7,
         model: str | None = None) -> ChildCall:
    target = Target(instance, role, instance.partition("@")[2], model or role)
    return ChildCall(role, target, room, "", "", inputs={"text_input": prompt, "sampling_parameters": b"{}",
                                                         "apply_chat_template": True},
                     prompt_token_ids=(1, 2, 3), tokenizer_id="tok")


class FakeTensor:
    """A python-backend input tensor as ``pb_utils`` hands it over: a name and ``as_numpy``."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeRequest:
    """A ``pb_utils.InferenceRequest`` as ``PDChildModel.handle`` reads it: inputs, id, parameters (JSON)."""

    def __init__(self, arrays: dict[str, np.ndarray], request_id: str, parameters: dict[str, Any]) -> None:
        self._tensors = [FakeTensor(n, a) for n, a in arrays.items()]
        self._id, self._parameters = request_id, json.dumps(parameters)

    def inputs(self) -> list[FakeTensor]:
        return self._tensors

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return self._parameters


def as_python_backend(wire: Any) -> dict[str, np.ndarray]:
    """The inputs of a ``ModelInferRequest`` as tritonserver's python backend gives them to ``as_numpy``:
    BYTES as object arrays of ``bytes``, the rest in their dtypes, each in its sent shape (built apart from
    ``request_arrays``: element by element from the length prefixes)."""
    dtypes = {"INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
    arrays = {}
    for tensor, raw in zip(wire.inputs, wire.raw_input_contents):
        shape = tuple(tensor.shape)
        if tensor.datatype == "BYTES":
            elements, at = [], 0
            while at < len(raw):
                n = int.from_bytes(raw[at:at + 4], "little")
                elements.append(bytes(raw[at + 4:at + 4 + n]))
                at += 4 + n
            array = np.empty(len(elements), dtype=np.object_)
            array[:] = elements
            arrays[tensor.name] = array.reshape(shape)
        else:
            arrays[tensor.name] = np.frombuffer(raw, dtype=dtypes[tensor.datatype]).reshape(shape)
    return arrays


def test_the_digest_is_the_same_from_the_router_the_endpoint_and_the_python_backend() -> None:
    from serving.triton.pd_model import read_child_inputs

    sent = call(prompt="héllo, wörld".encode())
    wire = child_request(sent)
    router = inputs_digest("decode", child_request_id(sent), child_arrays(sent))
    endpoint = inputs_digest(wire.model_name, wire.id, request_arrays(wire))
    backend_request = FakeRequest(as_python_backend(wire), wire.id, {})
    backend = inputs_digest("decode", backend_request.request_id(), read_child_inputs(backend_request))
    assert router == endpoint == backend and len(router) == 32
    # the order the inputs come in does not matter; a str element digests as its UTF-8 bytes
    arrays = child_arrays(sent)
    assert inputs_digest("decode", wire.id, dict(reversed(list(arrays.items())))) == router
    as_str = {**arrays, "text_input": np.array(["héllo, wörld"], dtype=np.object_)}
    assert inputs_digest("decode", wire.id, as_str) == router


@pytest.mark.parametrize("change", ["prompt", "extra input", "dtype", "shape", "request id", "model"])
def test_the_digest_changes_with_anything_the_request_carries(change: str) -> None:
    arrays = child_arrays(call())
    base = inputs_digest("decode", "7-decode", arrays)
    model, request_id = "decode", "7-decode"
    if change == "prompt":
        arrays["text_input"] = np.array([b"What is my bank password?"], dtype=np.object_)
    elif change == "extra input":
        arrays["resume_token_ids"] = np.array([5], dtype=np.int32)
    elif change == "dtype":
        arrays["bootstrap_room"] = arrays["bootstrap_room"].astype(np.int32)
    elif change == "shape":
        arrays["prompt_token_ids"] = arrays["prompt_token_ids"].reshape(1, 3)
    elif change == "request id":
        request_id = "8-decode"
    else:
        model = "decode_1"
    assert inputs_digest(model, request_id, arrays) != base


def test_bytes_elements_are_length_prefixed_so_boundaries_count() -> None:
    one = {"text_input": np.array([b"ab", b"c"], dtype=np.object_)}
    other = {"text_input": np.array([b"a", b"bc"], dtype=np.object_)}
    assert inputs_digest("m", "", one) != inputs_digest("m", "", other)


def test_a_signature_verifies_for_its_request_and_instance_only() -> None:
    now = 1_700_000_000.0
    arrays = child_arrays(call())
    header = sign_call(SECRET, DECODE, "decode", "7-decode", arrays, now)
    verify_call(SECRET, DECODE, "decode", "7-decode", arrays, header, now + 29)   # valid: returns
    other_prompt = {**arrays, "text_input": np.array([b"What is my bank password?"], dtype=np.object_)}
    refusals = {
        "another prompt": (DECODE, "decode", "7-decode", other_prompt, now),
        "another instance": ("decode@10.0.0.3:8001", "decode", "7-decode", arrays, now),
        "another request id": (DECODE, "decode", "8-decode", arrays, now),
        "another model": (DECODE, "prefill", "7-decode", arrays, now),
    }
    for instance, model, request_id, inputs, at in refusals.values():
        with pytest.raises(AuthError, match="bad signature"):
            verify_call(SECRET, instance, model, request_id, inputs, header, at)
    with pytest.raises(AuthError, match="timestamp outside the 30 s window"):
        verify_call(SECRET, DECODE, "decode", "7-decode", arrays, header, now + 31)
    with pytest.raises(AuthError, match="bad signature"):
        verify_call(b"another secret", DECODE, "decode", "7-decode", arrays, header, now)
    with pytest.raises(AuthError, match="missing"):
        verify_call(SECRET, DECODE, "decode", "7-decode", arrays, None, now)


def test_the_worker_admits_a_signed_request_once_and_refuses_a_captured_one_on_another_request() -> None:
    clock = [1_700_000_000.0]
    auth = ChildAuth(SECRET, DECODE, clock=lambda: clock[0])
    prefill_call = call("prefill", PREFILL)
    captured = sign_call(SECRET, PREFILL, "prefill", "7-prefill", child_arrays(prefill_call), clock[0])
    attack = child_arrays(call(prompt=b"What is my bank password?"))
    with pytest.raises(ChildUnauthenticated, match="^unauthenticated child request: bad signature"):
        auth.check(captured, "decode", "7-prefill", attack)   # the prefill's signature on a decode of our own
    with pytest.raises(ChildUnauthenticated, match="^unauthenticated child request: missing"):
        auth.check(None, "decode", "7-decode", attack)
    good = child_arrays(call())
    header = sign_call(SECRET, DECODE, "decode", "7-decode", good, clock[0])
    auth.check(header, "decode", "7-decode", good)
    with pytest.raises(ChildUnauthenticated, match="replayed request"):   # either path: one guard
        auth.check(header, "decode", "7-decode", good)
    clock[0] += 31
    fresh = sign_call(SECRET, DECODE, "decode", "7-decode", good, clock[0] - 31)
    with pytest.raises(ChildUnauthenticated, match="timestamp outside"):
        auth.check(fresh, "decode", "7-decode", good)
    with pytest.raises(ChildUnauthenticated, match="no Triton data type"):
        auth.check(header, "decode", "7-decode", {"x": np.array([1j])})


def test_without_a_secret_nothing_is_checked() -> None:
    NO_AUTH.check(None, "decode", "7-decode", child_arrays(call()))
    assert sign_child(call(), None) == ""
    assert AUTH_PARAMETER not in child_request(call()).parameters


def test_the_router_signs_each_call_for_its_target_and_the_worker_reads_it_where_it_travels() -> None:
    from serving.triton.pd_model import read_child_inputs, read_signature

    sent = call()
    signature = sign_child(sent, SECRET)
    wire = child_request(sent, signature)
    assert wire.parameters[AUTH_PARAMETER].string_param == signature
    auth = ChildAuth(SECRET, DECODE)
    backend = FakeRequest(as_python_backend(wire), wire.id, {AUTH_PARAMETER: signature,
                                                            "triton_enable_empty_final_response": True})
    assert read_signature(backend) == signature
    auth.check(read_signature(backend), "decode", backend.request_id(), read_child_inputs(backend))
    assert read_signature(FakeRequest({}, "", {})) is None
    assert sign_child(sent, SECRET) != signature   # a fresh nonce on every call
    elsewhere = call(instance="decode@10.0.0.3:8001")
    with pytest.raises(ChildUnauthenticated, match="bad signature"):
        auth.check(sign_child(elsewhere, SECRET), "decode", "7-decode", child_arrays(sent))
    assert time.time() - int(signature.split("t=")[1].split(",")[0]) < 5
