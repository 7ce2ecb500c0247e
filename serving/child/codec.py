"""The child protocol's messages: what ``pd_ensemble`` sends a prefill or decode model, what comes back, the
encoders and decoders of both sides next to each other, and the schema hash both sides check.

``CHILD_INPUTS`` and ``CHILD_OUTPUTS`` are the protocol: every input the router may send (with the roles that
take it) and every output a child answers with, in Triton data types (the outputs are ``serving.schema``'s
child layout); the prefill and decode models declare them (the inputs in ``config.pbtxt``, the outputs by
auto-complete from the schema; ``tests/serving/test_child_codec.py`` and
``tests/serving/test_response_schema.py`` hold them to each other). ``SCHEMA_HASH`` hashes them with
``CHILD_PROTOCOL_VERSION`` (raise it for a change of meaning that keeps names and types); the router sends it
in ``child_schema`` and a child of another build answers that request with an error naming both hashes
(``ChildSchemaMismatch``, an ``INSTANCE`` error: the fleet runs two builds), instead of failing on a missing
input or output or, worse, misreading one. A request without ``child_schema`` (a client's, a test's) is not
checked.

Request side: the router encodes (``serving.router.launch.child_arrays``), the child decodes
(``serving.parsing.pd_request.parse_pd_request``, which calls ``check_schema``). Response side:
``encode_response`` (child) and ``decode_raw_response`` (router, on Triton's raw output contents;
``decode_response`` on arrays), both driven by the schema's rows. Text outputs are UTF-8 bytes in UINT8
tensors, never BYTES (why: ``encode_response``). Meanings of each field: docs/protocol.md, "Child requests".
Signatures of child requests: ``serving.child.signing``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engine.outputs import TokenLogprob
from serving.delta import Delta, ErrorKind
from serving.schema import OUTPUTS

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
    "dp_rank": ("TYPE_INT32", BOTH),
    SCHEMA_INPUT: ("TYPE_STRING", BOTH),
}
#: output → Triton data type: every output of every child response (``serving.schema``'s child layout)
CHILD_OUTPUTS: dict[str, str] = {o.name: o.child.data_type for o in OUTPUTS if o.child is not None}
SCHEMA_HASH: str = hashlib.sha256(json.dumps(
    {"version": CHILD_PROTOCOL_VERSION, "inputs": {k: [t, list(r)] for k, (t, r) in CHILD_INPUTS.items()},
     "outputs": CHILD_OUTPUTS}, sort_keys=True).encode()).hexdigest()[:12]


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
        raise ChildSchemaMismatch(f"child protocol mismatch: the router speaks child schema {sent!r}, "
                                  f"this child {SCHEMA_HASH!r} (run one build of the project across the "
                                  f"fleet)")


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


#: Delta attribute → (its value → the text a UINT8 output carries, that text → the value) for the text fields
_TEXTS: dict[str, tuple[Callable[[Any], str], Callable[[str], Any]]] = {
    "text": (str, str),
    "finish_reason": (lambda reason: reason or "", lambda text: text or None),
    "logprobs": (logprobs_to_wire, logprobs_from_wire),
    "error": (lambda error: error or "", lambda text: text or None),
    "error_kind": (lambda kind: kind.value, ErrorKind.from_wire),
}
#: Triton data type of a child output → its numpy dtype (little-endian, as Triton's raw contents are)
_DTYPES: dict[str, np.dtype] = {"TYPE_UINT8": np.dtype(np.uint8), "TYPE_INT32": np.dtype("<i4"),
                                "TYPE_FP32": np.dtype("<f4")}
#: (output name, Delta attribute, numpy dtype, one value (dims [1]), sent at its default) per child output
_ROWS: tuple[tuple[str, str, np.dtype, bool, bool], ...] = tuple(
    (o.name, o.child.attribute, _DTYPES[o.child.data_type], o.child.dims == (1,), o.child.always)
    for o in OUTPUTS if o.child is not None)
_DEFAULTS = Delta()


def encode_response(delta: Delta) -> dict[str, np.ndarray]:
    """Child side: the output arrays of one prefill/decode response to ``pd_ensemble`` (its one sample's
    delta, or ``Delta.failure``), by name, in ``CHILD_OUTPUTS``' types: the schema's ``always`` outputs
    (``text_output``, ``num_output_tokens``) always, every other output only when it differs from what its
    absence decodes to (``decode_raw_response``: empty text, 0, no logprobs, no error; ``error_kind`` goes
    with ``error``), so a streamed token is 3 tensors, not 10 (each costs a tensor in the stub, in
    tritonserver and on the wire, once per token). The text fields are UTF-8 ``uint8`` arrays
    (``[num_bytes]``), never BYTES: tritonserver 2.51's python backend corrupts the object dtype's reference
    count when a BLS model reads BYTES outputs of a decoupled child (``as_numpy``): after ~1.5k responses
    pd_ensemble's stub died with "Reference count error detected ... dtype 17 (O)"."""
    arrays = {}
    for name, attribute, dtype, _, always in _ROWS:
        value = getattr(delta, attribute)
        if attribute == "error_kind":   # sent with an error, and only then
            if not delta.error:
                continue
        elif not always and (value == getattr(_DEFAULTS, attribute) or value == ""):
            continue
        if attribute in _TEXTS:
            arrays[name] = utf8_array(_TEXTS[attribute][0](value))
        else:
            arrays[name] = np.array(value if isinstance(value, tuple) else [value], dtype=dtype)
    return arrays


def decode_response(values: Mapping[str, np.ndarray], final: bool) -> Delta:
    """Router side, from arrays: a child's output arrays (absent outputs left out) and its FINAL flag → the
    ``Delta`` they say; ``decode_raw_response`` on each array's bytes. Raises ValueError on malformed
    ``logprobs``."""
    return decode_raw_response({name: np.ascontiguousarray(array)
                                .astype(_DTYPES[CHILD_OUTPUTS[name]], copy=False).tobytes()
                                for name, array in values.items() if name in CHILD_OUTPUTS}, final)


def decode_raw_response(raw: Mapping[str, bytes], final: bool) -> Delta:
    """Router side, from the wire: a child's outputs as Triton's raw contents (output name → bytes: UTF-8 text
    for the ``UINT8`` outputs, little-endian ``INT32``/``FP32`` values; absent outputs left out) and its FINAL
    flag → the ``Delta`` they say (``final`` set from the flag; an error is always final); no outputs: FINAL
    alone. Inverse of ``encode_response``; one pass over the outputs sent (it runs once per streamed token on
    the router's event loop). Raises ValueError on malformed ``logprobs`` or text that is not UTF-8."""
    if not raw:
        return Delta(final=final)
    error = bytes(raw.get("error", b"")).decode("utf-8")
    if error:
        return Delta.failure(error, ErrorKind.from_wire(bytes(raw.get("error_kind", b"")).decode("utf-8")))
    values: dict[str, Any] = {}
    for name, attribute, dtype, one, _ in _ROWS:
        data = raw.get(name)
        if not data or attribute in ("error", "error_kind"):
            continue
        if attribute in _TEXTS:
            values[attribute] = _TEXTS[attribute][1](bytes(data).decode("utf-8"))
        elif len(data) < dtype.itemsize:
            continue
        elif one:
            values[attribute] = np.frombuffer(data[:dtype.itemsize], dtype)[0].item()
        else:
            values[attribute] = tuple(np.frombuffer(data, dtype).tolist())
    return Delta(**values, final=final)
