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

Signatures (with a fleet secret): the router signs each child request with ``sign_call``, bound to the target
instance and to ``inputs_digest`` of the request (model, request id, every input); the worker checks it with
``verify_call`` (``serving.workers.child_auth``) on both paths into it before any work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from bootstrap.auth import AuthError, sign, verify
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
#: The request parameter (a string) that carries a child request's fleet signature through tritonserver; on a
#: worker's own endpoint the signature travels in the stream's ``OPEN`` frame instead (``child_frames``).
AUTH_PARAMETER = "pd_fleet_auth"
_DIGEST_DOMAIN = b"pd-child-inputs-v1\n"
#: numpy dtype kind + item size → Triton data type (object, bytes and str arrays are ``BYTES``)
_TRITON_TYPES = {("b", 1): "BOOL", ("u", 1): "UINT8", ("u", 2): "UINT16", ("u", 4): "UINT32",
                 ("u", 8): "UINT64", ("i", 1): "INT8", ("i", 2): "INT16", ("i", 4): "INT32",
                 ("i", 8): "INT64", ("f", 2): "FP16", ("f", 4): "FP32", ("f", 8): "FP64"}


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _content(array: np.ndarray) -> tuple[str, bytes]:
    """(Triton data type, the elements as Triton's raw contents) of one input array."""
    if array.dtype.kind in "OSU":
        elements = [e if isinstance(e, bytes) else str(e).encode("utf-8") for e in array.reshape(-1).tolist()]
        return "BYTES", b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    datatype = _TRITON_TYPES.get((array.dtype.kind, array.dtype.itemsize))
    if datatype is None:
        raise ValueError(f"numpy dtype {array.dtype} is no Triton data type")
    return datatype, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def inputs_digest(model_name: str, request_id: str, inputs: Mapping[str, np.ndarray]) -> bytes:
    """The 32-byte SHA-256 digest of one child request as a signature binds it: the model it is sent to, its
    request id and every input it carries, computed from numpy arrays, so that the router (``child_arrays``),
    a worker's endpoint (``request_arrays``) and the Triton path (the python backend's input tensors) get the
    same digest for the same request. The bytes hashed, integers little-endian, ``F(x)`` = u64 length + x::

        b"pd-child-inputs-v1\n" F(model name, UTF-8) F(request id, UTF-8) u32(number of inputs)
        then per input, sorted by the UTF-8 bytes of its name:
            F(name, UTF-8) F(Triton data type, ASCII: "BYTES", "INT64", ...)
            u32(ndim) i64(dim) x ndim F(content)

    ``content`` is Triton's raw contents of the input: ``BYTES`` elements each as u32 length + bytes (str
    elements UTF-8 encoded), any other type its elements' little-endian bytes, both in C order. The data type
    follows the array's dtype (object, bytes or str: ``BYTES``; ``bool``: ``BOOL``; ``int32``: ``INT32``...).

    Raises:
        ValueError: an array of a dtype Triton has no data type for.
    """
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    digest.update(_field(model_name.encode("utf-8")) + _field(request_id.encode("utf-8")))
    digest.update(len(inputs).to_bytes(4, "little"))
    for name in sorted(inputs, key=lambda n: n.encode("utf-8")):
        array = np.asarray(inputs[name])
        datatype, content = _content(array)
        digest.update(_field(name.encode("utf-8")) + _field(datatype.encode("ascii")))
        digest.update(array.ndim.to_bytes(4, "little") + b"".join(int(d).to_bytes(8, "little", signed=True)
                                                                   for d in array.shape))
        digest.update(_field(content))
    return digest.digest()


def sign_call(secret: bytes, target_instance_id: str, model_name: str, request_id: str,
              inputs: Mapping[str, np.ndarray], now_s: float) -> str:
    """Router side: the fleet signature of one child request (an ``X-PD-Fleet-Auth`` value,
    ``bootstrap.auth``): ``bootstrap.auth.sign`` over ``POST``, the target instance's id as the authority
    (``Target.instance_id``, ``<model>@<grpc host:port>``), ``STREAM_METHOD`` as the path and
    ``inputs_digest(model_name, request_id, inputs)`` as the body. So it signs one request for one instance:
    another prompt, input, model, request id or instance fails it. ``inputs``: every input array sent, by
    name; ``now_s``: unix seconds. Raises ``ValueError`` as ``inputs_digest``."""
    digest = inputs_digest(model_name, request_id, inputs)
    return sign(secret, "POST", target_instance_id, STREAM_METHOD, digest, now_s)


def verify_call(secret: bytes, instance_id: str, model_name: str, request_id: str,
                inputs: Mapping[str, np.ndarray], header: str | None, now_s: float) -> None:
    """Child side, the inverse of ``sign_call``: ``instance_id`` is this worker's own id, the rest is what the
    request carries (its model name, request id and every input array, by name). Raises
    ``bootstrap.auth.AuthError`` naming the reason (missing, malformed, stale or wrong signature: another
    instance, another request or an altered one) and ``ValueError`` as ``inputs_digest``; replays are the
    caller's to refuse (``bootstrap.auth.ReplayGuard``)."""
    digest = inputs_digest(model_name, request_id, inputs)
    verify(secret, "POST", instance_id, STREAM_METHOD, digest, header, now_s)


class ChildUnauthenticated(AuthError):
    """A child request without a valid, fresh, never-seen fleet signature for this instance; ``str()`` is
    ``"unauthenticated child request: <reason>"``. The worker answers it with that message as an ``INSTANCE``
    error and FINAL, before any work."""


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
