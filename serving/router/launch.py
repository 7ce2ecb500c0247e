"""The ``Launcher`` seam: send one child request (prefill or decode) and stream its responses.

``GrpcLauncher`` reaches the child over asyncio gRPC streaming (Triton's ``ModelStreamInfer`` through the service
stub tritonclient ships, ``tritonclient.grpc.service_pb2_grpc``) at its target's endpoint: the worker's own endpoint
(``serving.workers.endpoint``, the same service for one model) when it has one, else the tritonserver that serves
it, whichever server that is (the router's own included): one bidirectional stream per child request, so that cancelling the stream cancels
exactly that request (Triton then reports ``is_cancelled()`` to the child, which aborts it and frees its
pages). Why not BLS for the router's own server: docs/architecture.md, "Why the router speaks gRPC". Why the
stub and not ``tritonclient.grpc.aio.InferenceServerClient.stream_infer``: that client wraps every response in an
``InferResult`` whose ``as_numpy`` scans the outputs once per name; the router reads each child response (one per
streamed token) once, straight from its raw contents (``child_codec.decode_raw_response``): 110 -> ~20 us per
response measured here.

Child protocol: ``serving.parsing.child_codec`` (inputs, outputs and their types, the response decoder this module uses,
the schema hash ``child_arrays`` sends). A child reports a failure as a FINAL response whose ``error`` (and
``error_kind``) is set.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from serving.parsing.child_codec import (
    AUTH_METADATA,
    CHILD_OUTPUTS,
    SCHEMA_HASH,
    SCHEMA_INPUT,
    decode_raw_response,
    sign_call,
)
from serving.parsing.request import RawValue
from serving.router.channels import ChannelPool
from serving.router.fleet import Target
from serving.stream import Delta

Room = int
#: Inputs of the client's request that are forwarded as they are to both children.
FORWARDED_INPUTS: tuple[str, ...] = ("text_input", "sampling_parameters", "apply_chat_template")


@dataclass(frozen=True)
class ChildCall:
    """One child request of one attempt.

    Attributes:
        role: ``"prefill"`` or ``"decode"``.
        target: the instance that serves it.
        room: the bootstrap room of the attempt.
        prefill_instance: decode only: the paired prefill's instance id; empty: direct decode.
        prefill_rendezvous: decode only: the paired prefill's own rendezvous URL.
        inputs: the client's forwarded inputs (``FORWARDED_INPUTS``), as parsed scalars.
        resume_token_ids: decode only, direct: the tokens already sent to the client (a migration); empty: a
            new request.
        prompt_token_ids: the prompt's ids from the router's tokenizer (chat template applied); empty: not
            tokenized (the child tokenizes ``text_input``).
        tokenizer_id: that tokenizer's fingerprint (the child uses the ids only when it is its own).
    """

    role: str
    target: Target
    room: Room
    prefill_instance: str
    prefill_rendezvous: str
    inputs: Mapping[str, RawValue] = field(default_factory=dict)
    resume_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    tokenizer_id: str = ""


class ChildUnavailable(Exception):
    """The child's server could not be reached, or its stream broke (the instance is likely down)."""


class Launcher(Protocol):
    """Sends child requests. ``stream`` is called on the router's event loop thread."""

    def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        """Send ``call`` and yield its responses up to the FINAL one (an ``error`` response is final).
        Closing the iterator early (``aclose``, or cancelling the task that iterates) cancels the child
        request. Raises ``ChildUnavailable`` when the child cannot be reached or its stream breaks."""
        ...

    def reset(self, endpoint: str) -> None:
        """The router lost touch with ``endpoint`` (its instance stopped answering): the next call to it opens a
        new connection; streams open on the old one go on until they end."""
        ...

    async def close(self) -> None:
        """Release connections (after every stream ended)."""
        ...


def child_arrays(call: ChildCall) -> dict[str, np.ndarray]:
    """The child request's input arrays, by input name (shape ``[1]`` each; ``resume_token_ids`` and
    ``prompt_token_ids``: ``[k]``)."""
    arrays: dict[str, np.ndarray] = {}
    for name in FORWARDED_INPUTS:
        if name in call.inputs:
            value = call.inputs[name]
            arrays[name] = (np.array([value], dtype=np.bool_) if isinstance(value, bool) else
                            np.array([value if isinstance(value, bytes) else str(value).encode()], dtype=np.object_))
    arrays["bootstrap_room"] = np.array([call.room], dtype=np.int64)
    arrays[SCHEMA_INPUT] = np.array([SCHEMA_HASH.encode()], dtype=np.object_)
    if call.role == "decode":
        arrays["prefill_instance"] = np.array([call.prefill_instance.encode()], dtype=np.object_)
        arrays["prefill_rendezvous"] = np.array([call.prefill_rendezvous.encode()], dtype=np.object_)
        if call.resume_token_ids:
            arrays["resume_token_ids"] = np.array(call.resume_token_ids, dtype=np.int32)
    if call.prompt_token_ids and call.tokenizer_id:
        arrays["prompt_token_ids"] = np.array(call.prompt_token_ids, dtype=np.int32)
        arrays["tokenizer_id"] = np.array([call.tokenizer_id.encode()], dtype=np.object_)
    return arrays


def child_request(call: ChildCall) -> Any:
    """The ``ModelInferRequest`` (``tritonclient.grpc.service_pb2``) of ``call``: its inputs (``child_arrays``) as
    raw contents (BYTES as Triton's length-prefixed elements), every ``CHILD_OUTPUTS`` requested, request id
    ``"<room>-<role>"``, and ``triton_enable_empty_final_response`` so the FINAL flag always comes."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=call.target.model_name, id=f"{call.room}-{call.role}")
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in child_arrays(call).items():
        tensor = request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype))
        tensor.shape.extend(array.shape)
        if array.dtype == np.object_:
            serialized = serialize_byte_tensor(array)
            request.raw_input_contents.append(serialized.item() if serialized.size else b"")
        else:
            request.raw_input_contents.append(array.tobytes())
    for name in CHILD_OUTPUTS:
        request.outputs.add(name=name)
    return request


class GrpcLauncher:
    """Child requests over asyncio gRPC; one channel per endpoint (``ChannelPool``: a channel that failed to
    connect is replaced, so a restarted server is reached on the next call), one stream per call. Keepalive
    pings every ``keepalive_s`` (300 s: tritonserver's default policy refuses pings more often than every 5
    minutes, or on a channel without calls, with GOAWAY ``too_many_pings``), so plain tritonserver needs no
    ``--grpc-*`` flags. A dead host is noticed sooner by the fleet watcher (its rendezvous stops answering) and
    by ``request_idle_timeout_s``.
    """

    def __init__(self, keepalive_s: float = 300.0, fleet_secret: bytes | None = None) -> None:
        """``fleet_secret``: every stream carries its signature (``serving.parsing.child_codec.sign_call``), which a
        worker endpoint checks (tritonserver ignores it)."""
        self._channels = ChannelPool(keepalive_s)
        self._secret = fleet_secret

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        import asyncio

        import grpc

        request = child_request(call)
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await ended.wait()   # keep our half open until the child's FINAL: closing it ends the stream

        channel = self._channels.acquire(call.target.endpoint)
        metadata = None if self._secret is None else \
            ((AUTH_METADATA, sign_call(self._secret, request.id, time.time())),)
        responses = channel.client.stub.ModelStreamInfer(requests(), metadata=metadata)
        finished = False
        try:
            async for response in responses:
                if response.error_message:
                    finished = True
                    yield Delta.failure(f"{call.role} {call.target.instance_id}: {response.error_message}")
                    return
                result = response.infer_response
                final = result.parameters["triton_final_response"].bool_param
                raw = result.raw_output_contents
                delta = decode_raw_response({output.name: raw[i] for i, output in enumerate(result.outputs)
                                             if i < len(raw)}, final)
                finished = delta.final
                yield delta
                if finished:
                    return
            raise ChildUnavailable(f"{call.role} {call.target.instance_id}: stream ended without FINAL")
        except grpc.RpcError as e:
            # the connection is suspect (a server restarted, a path back after a partition, a reconnect backoff
            # under way): the next call opens a new one
            self._channels.retire(channel)
            raise ChildUnavailable(f"{call.role} {call.target.instance_id} at {call.target.endpoint} "
                                   f"unreachable: {_rpc_message(e)}") from None
        finally:
            ended.set()
            if not finished:
                responses.cancel()   # Triton cancels the child request: it aborts and frees its pages
            self._channels.release(channel)

    def reset(self, endpoint: str) -> None:
        self._channels.retire_endpoint(endpoint)

    async def close(self) -> None:
        await self._channels.close()


def _rpc_message(error: BaseException) -> str:
    details = getattr(error, "details", None)
    code = getattr(error, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return str(error)
