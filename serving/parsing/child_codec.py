"""The child protocol in one place: what ``pd_ensemble`` sends a prefill or decode model, what comes back, the
encoders and decoders of both sides next to each other, and the schema hash both sides check.

``CHILD_INPUTS`` and ``CHILD_OUTPUTS`` are the protocol: every input the router may send (with the roles that
take it) and every output a child answers with, in Triton data types; the prefill and decode ``config.pbtxt``
declare them (``tests/serving/test_child_codec.py`` holds the three to each other). ``SCHEMA_HASH`` hashes
them with ``CHILD_PROTOCOL_VERSION`` (raise it for a change of meaning that keeps names and types); the router
sends it in ``child_schema`` and a child of another build answers that request with an error naming both
hashes (``ChildSchemaMismatch``, an ``INSTANCE`` error: the fleet runs two builds), instead of failing on a
missing input or output or, worse, misreading one. A request without ``child_schema`` (a client's, a test's) is
not checked.

Request side: the router encodes (``serving.router.launch.child_arrays``), the child decodes
(``serving.parsing.pd_request.parse_pd_request``, which calls ``check_schema``). Response side: ``encode_response``
(child) and ``decode_raw_response`` (router, on Triton's raw output contents; ``decode_response`` on arrays). Text outputs are UTF-8 bytes in UINT8 tensors, never BYTES (why:
``encode_response``). Meanings of each field: docs/protocol.md, "Child requests".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from bootstrap.auth import sign, verify
from engine.outputs import TokenLogprob
from serving.stream import Delta, ErrorKind

#: Raise for a change of meaning that keeps every name and type (a new unit, a new rule for an old field).
CHILD_PROTOCOL_VERSION = 1

PREFILL, DECODE = "prefill", "decode"
BOTH = (PREFILL, DECODE)
SCHEMA_INPUT = "child_schema"

#: input → (Triton data type, the roles that take it): every input the router may send a child
CHILD_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "text_input": ("TYPE_STRING", BOTH),
    "sampling_parameters": ("TYPE_STRING", BOTH),
    "apply_chat_template": ("TYPE_BOOL", BOTH),
    "bootstrap_room": ("TYPE_INT64", BOTH),
    "prefill_instance": ("TYPE_STRING", (DECODE,)),
    "prefill_rendezvous": ("TYPE_STRING", (DECODE,)),
    "resume_token_ids": ("TYPE_INT32", (DECODE,)),
    "prompt_token_ids": ("TYPE_INT32", BOTH),
    "tokenizer_id": ("TYPE_STRING", BOTH),
    SCHEMA_INPUT: ("TYPE_STRING", BOTH),
}
#: output → Triton data type: every output of every child response
CHILD_OUTPUTS: dict[str, str] = {
    "text_output": "TYPE_UINT8",
    "finish_reason": "TYPE_UINT8",
    "num_input_tokens": "TYPE_INT32",
    "num_output_tokens": "TYPE_INT32",
    "num_cached_tokens": "TYPE_INT32",
    "cumulative_logprob": "TYPE_FP32",
    "logprobs": "TYPE_UINT8",
    "output_token_ids": "TYPE_INT32",
    "error": "TYPE_UINT8",
    "error_kind": "TYPE_UINT8",
}
SCHEMA_HASH: str = hashlib.sha256(json.dumps(
    {"version": CHILD_PROTOCOL_VERSION, "inputs": {k: [t, list(r)] for k, (t, r) in CHILD_INPUTS.items()},
     "outputs": CHILD_OUTPUTS}, sort_keys=True).encode()).hexdigest()[:12]


#: The gRPC method every child stream calls (Triton's, served by tritonserver or a worker's own endpoint).
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def sign_call(secret: bytes, request_id: str, now_s: float) -> str:
    """Router side: the fleet signature of one child stream whose request id is ``request_id`` (sent in its
    ``OPEN`` frame, ``child_frames``)
    (``bootstrap.auth.sign`` over ``POST``, ``STREAM_METHOD`` and the id's bytes); ``now_s``: unix seconds."""
    return sign(secret, "POST", "", STREAM_METHOD, request_id.encode(), now_s)


def verify_call(secret: bytes, request_id: str, header: str | None, now_s: float) -> None:
    """Child side, the inverse of ``sign_call``. Raises ``bootstrap.auth.AuthError`` naming the reason (missing,
    malformed, stale or wrong signature); replays are the caller's to refuse."""
    verify(secret, "POST", "", STREAM_METHOD, request_id.encode(), header, now_s)


class ChildSchemaMismatch(Exception):
    """The router that sent this request speaks another child schema than this child (two builds in one
    fleet). The child answers with this message as an ``INSTANCE`` error."""


def check_schema(pd_inputs: Mapping[str, np.ndarray]) -> None:
    """Child side, before anything else is read: raises ``ChildSchemaMismatch`` when ``child_schema`` is sent
    and is not ``SCHEMA_HASH``; absent: nothing to check."""
    array = pd_inputs.get(SCHEMA_INPUT)
    if array is None:
        return
    value = np.asarray(array).reshape(-1)
    first = value[0] if value.size else b""
    sent = first.decode() if isinstance(first, bytes) else str(first)
    if sent != SCHEMA_HASH:
        raise ChildSchemaMismatch(f"child protocol mismatch: the router speaks child schema {sent!r}, this child "
                                  f"{SCHEMA_HASH!r} (run one build of the project across the fleet)")


def utf8_array(text: str) -> np.ndarray:
    """``text`` as a ``[num_bytes]`` uint8 array of its UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def logprobs_to_wire(entries: tuple[TokenLogprob, ...] | None) -> str:
    """Token logprobs in the child layout: ``""`` for None, else a JSON list of
    ``[token_id, logprob, rank, decoded_token, [[token_id, logprob, text], ...]]``."""
    if entries is None:
        return ""
    return json.dumps([[e.token_id, e.logprob, e.rank, e.decoded_token, [list(t) for t in e.top]]
                       for e in entries])


def logprobs_from_wire(text: str) -> tuple[TokenLogprob, ...] | None:
    """Inverse of ``logprobs_to_wire``. Raises ValueError on a malformed text."""
    if not text:
        return None
    try:
        return tuple(TokenLogprob(int(t), float(lp), int(rank), str(decoded),
                                  tuple((int(i), float(v), str(s)) for i, v, s in top))
                     for t, lp, rank, decoded, top in json.loads(text))
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed child logprobs: {e}") from None


def encode_response(delta: Delta) -> dict[str, np.ndarray]:
    """Child side: the output arrays of one prefill/decode response to ``pd_ensemble`` (its one sample's delta,
    or ``Delta.failure``), by name, in ``CHILD_OUTPUTS``' types: ``text_output`` and ``num_output_tokens`` always,
    every other output only when it differs from what its absence decodes to (``decode_raw_response``: empty
    text, 0, no logprobs, no error), so a streamed token is 3 tensors, not 10 (each costs a tensor in the stub,
    in tritonserver and on the wire, once per token). The text fields are UTF-8 ``uint8`` arrays
    (``[num_bytes]``), never BYTES: tritonserver 2.51's python backend corrupts the object dtype's reference
    count when a BLS model reads BYTES outputs of a decoupled child (``as_numpy``): after ~1.5k responses
    pd_ensemble's stub died with "Reference count error detected ... dtype 17 (O)"."""
    arrays = {"text_output": utf8_array(delta.text),
              "num_output_tokens": np.array([delta.num_output_tokens], dtype=np.int32)}
    if delta.token_ids:
        arrays["output_token_ids"] = np.array(delta.token_ids, dtype=np.int32)
    if delta.finish_reason:
        arrays["finish_reason"] = utf8_array(delta.finish_reason)
    if delta.num_input_tokens:
        arrays["num_input_tokens"] = np.array([delta.num_input_tokens], dtype=np.int32)
    if delta.num_cached_tokens:
        arrays["num_cached_tokens"] = np.array([delta.num_cached_tokens], dtype=np.int32)
    if delta.cumulative_logprob:
        arrays["cumulative_logprob"] = np.array([delta.cumulative_logprob], dtype=np.float32)
    if delta.logprobs is not None:
        arrays["logprobs"] = utf8_array(logprobs_to_wire(delta.logprobs))
    if delta.error:
        arrays["error"] = utf8_array(delta.error)
        arrays["error_kind"] = utf8_array(delta.error_kind.value)
    return arrays


def decode_response(values: Mapping[str, np.ndarray], final: bool) -> Delta:
    """Router side, from arrays: a child's output arrays (absent outputs left out) and its FINAL flag → the
    ``Delta`` they say; ``decode_raw_response`` on each array's bytes. Raises ValueError on malformed
    ``logprobs``."""
    return decode_raw_response({name: np.ascontiguousarray(array).astype(_DTYPES[CHILD_OUTPUTS[name]], copy=False)
                                .tobytes() for name, array in values.items() if name in CHILD_OUTPUTS}, final)


#: Triton data type of a child output → its numpy dtype (little-endian, as Triton's raw contents are)
_DTYPES: dict[str, np.dtype] = {"TYPE_UINT8": np.dtype(np.uint8), "TYPE_INT32": np.dtype("<i4"),
                                "TYPE_FP32": np.dtype("<f4")}


def decode_raw_response(raw: Mapping[str, bytes], final: bool) -> Delta:
    """Router side, from the wire: a child's outputs as Triton's raw contents (output name → bytes: UTF-8 text for
    the ``UINT8`` outputs, little-endian ``INT32``/``FP32`` values; absent outputs left out) and its FINAL flag →
    the ``Delta`` they say (``final`` set from the flag; an error is always final); no outputs: FINAL alone.
    Inverse of ``encode_response``; one pass, no numpy object per output (it runs once per streamed token on the
    router's event loop). Raises ValueError on malformed ``logprobs`` or text that is not UTF-8."""
    if not raw:
        return Delta(final=final)

    def text(name: str) -> str:
        return bytes(raw.get(name, b"")).decode("utf-8")

    def count(name: str) -> int:
        data = raw.get(name, b"")
        return int.from_bytes(data[:4], "little", signed=True) if len(data) >= 4 else 0

    error = text("error")
    if error:
        return Delta.failure(error, ErrorKind.from_wire(text("error_kind")))
    cumulative = raw.get("cumulative_logprob", b"")
    ids = raw.get("output_token_ids", b"")
    return Delta(text=text("text_output"), finish_reason=text("finish_reason") or None,
                 num_input_tokens=count("num_input_tokens"), num_output_tokens=count("num_output_tokens"),
                 cumulative_logprob=float(np.frombuffer(cumulative[:4], "<f4")[0]) if len(cumulative) >= 4 else 0.0,
                 logprobs=logprobs_from_wire(text("logprobs")), num_cached_tokens=count("num_cached_tokens"),
                 token_ids=tuple(np.frombuffer(ids, "<i4").tolist()) if ids else (), final=final)
