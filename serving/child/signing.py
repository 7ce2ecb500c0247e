"""Fleet signatures of child requests: what binds one signed child request to its target instance and to its
model, request id and every input (``inputs_digest``), and both sides' calls (``sign_call`` on the router,
``verify_call`` on the worker: ``serving.workers.child_auth``). The signature itself is ``bootstrap.auth``'s
HMAC-SHA256; through tritonserver it travels in the ``AUTH_PARAMETER`` request parameter, on a worker's own
endpoint in the stream's ``OPEN`` frame (``serving.child.frames``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from bootstrap.auth import AuthError, sign, verify

#: The gRPC method every child stream calls (Triton's, served by tritonserver or a worker's own endpoint).
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
#: The request parameter (a string) that carries a child request's fleet signature through tritonserver; on a
#: worker's own endpoint the signature travels in the stream's ``OPEN`` frame instead
#: (``serving.child.frames``).
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
