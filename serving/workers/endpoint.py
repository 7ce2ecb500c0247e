"""``WorkerEndpoint``: a PD worker's own gRPC endpoint, where routers send its child requests past tritonserver.

Why: through tritonserver a child request and each of its responses cross the server's gRPC frontend and the
python backend's shared-memory queues into and out of the stub, one hand-off between processes (each a wake-up
on a busy host) per direction; PD's first token crosses that path twice more than colocated's
(router -> prefill -> router), and every streamed token once more (decode -> router). The endpoint serves the
same request and response messages (Triton's ``inference.GRPCInferenceService/ModelStreamInfer``, from
``tritonclient.grpc.service_pb2``) from inside the worker's own process, so the router's ``GrpcLauncher`` uses it
unchanged, pointed at another address. Dynamo's disaggregated workers and SGLang's router reach workers on
their own endpoints the same way. Triton still serves the model as before (a client's requests, the router's
``describe``, plain ``tritonserver`` with no router).

Protocol: one child request per stream (the router's ``launch.child_request``: ``model_name`` must be this
worker's model, inputs as raw contents; ``child_codec.CHILD_INPUTS``); responses are ``ModelStreamInferResponse``s
in the child layout (``child_codec.encode_response``) with ``triton_final_response`` set on the last one, which
the router's ``decode_raw_response`` reads. A stream that fell behind gets its pending responses merged into one
(``serving.stream.merge_chunks``), as the Triton path's response thread does. Cancelling the stream (the router
closes it, or its connection drops) cancels the request: the worker sees ``is_cancelled`` and aborts the room.
A second request on one stream, another model's name, a bad input or a missing fleet signature each end that
stream with one FINAL error response; nothing else is touched.

Authentication: with a fleet secret (``bootstrap.auth``), every stream's metadata carries
``x-pd-fleet-auth`` signed over ``POST``, the method path and the request id (``child_codec.sign_call``); a
stream without a valid, fresh one is answered with an error. Without a secret the endpoint binds loopback only
(``check_bind``).

Threads: the endpoint runs its own asyncio loop on thread ``worker-endpoint-<port>``; the worker's sinks are fed
from the engine loop thread (``call_soon_threadsafe``, once per wake-up, not per response).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from bootstrap.auth import AuthError, _ReplayGuard, check_bind
from serving.answering import start_or_fail
from serving.parsing.child_codec import (
    AUTH_METADATA,
    CHILD_OUTPUTS,
    encode_response,
    verify_call,
)
from serving.parsing.pd_request import CONTROL_INPUT, PD_INPUT_NAMES, PDRequest, parse_pd_request
from serving.parsing.request import INPUT_NAMES, RequestError
from serving.stream import Delta, ErrorKind, ResponseChunk, ResponseSink, merge_chunks

if TYPE_CHECKING:
    from tritonclient.grpc import service_pb2

logger = logging.getLogger(__name__)

#: Triton data type of each child output, as ``ModelInferResponse.outputs[].datatype`` names it
_WIRE_TYPES = {"TYPE_UINT8": "UINT8", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32"}
#: numpy dtype of a raw input content by its Triton data type (``BYTES``: length-prefixed elements)
_INPUT_DTYPES = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "BOOL": np.dtype(np.bool_),
                 "UINT8": np.dtype(np.uint8)}


class ChildWorker(Protocol):
    """``PrefillWorker`` / ``DecodeWorker`` as the endpoint uses them: ``handle`` starts one request (any
    thread) and sends its responses to ``sink`` from the engine loop thread; raises ``RequestError`` /
    ``RequestRejected`` for a request it refuses."""

    def handle(self, pd: PDRequest, sink: ResponseSink) -> str: ...


def request_arrays(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    """The inputs of a ``ModelInferRequest`` sent with raw contents, as numpy arrays by name: ``BYTES`` as an object
    array of ``bytes`` (Triton's length-prefixed elements), ``INT64``/``INT32``/``BOOL``/``UINT8`` as their dtype,
    each reshaped to its declared shape.

    Raises:
        RequestError: naming an input sent without raw contents, of another data type, or whose contents do not
            fit its shape.
    """
    from tritonclient.utils import deserialize_bytes_tensor

    raw = request.raw_input_contents
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        if i >= len(raw):
            raise RequestError(tensor.name, "must be sent as raw contents (raw_input_contents)")
        shape = tuple(int(d) for d in tensor.shape)
        try:
            if tensor.datatype == "BYTES":
                array = deserialize_bytes_tensor(raw[i])
            elif tensor.datatype in _INPUT_DTYPES:
                array = np.frombuffer(raw[i], dtype=_INPUT_DTYPES[tensor.datatype])
            else:
                raise RequestError(tensor.name, f"data type {tensor.datatype} is not a child input's")
            arrays[tensor.name] = array.reshape(shape)
        except (ValueError, IndexError, struct.error) as e:   # a short buffer, a length past the end, a bad shape
            raise RequestError(tensor.name, f"malformed raw contents for shape {list(shape)}: {e}") from None
    return arrays


def response_message(delta: Delta, final: bool, model_name: str, request_id: str
                     ) -> service_pb2.ModelStreamInferResponse:
    """One child response as Triton's gRPC frontend would send it: ``delta`` in the child layout
    (``encode_response``; nothing for a bare FINAL), raw contents, ``triton_final_response`` = ``final``."""
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelStreamInferResponse()
    result = message.infer_response
    result.model_name, result.id = model_name, request_id
    result.parameters["triton_final_response"].bool_param = final
    if delta == Delta(final=delta.final):   # a bare FINAL: no outputs (decodes to Delta(final=True))
        return message
    for name, array in encode_response(delta).items():
        output = result.outputs.add(name=name, datatype=_WIRE_TYPES[CHILD_OUTPUTS[name]])
        output.shape.extend(array.shape)
        result.raw_output_contents.append(array.tobytes())
    return message


class _StreamSink:
    """``ResponseSink`` of one endpoint stream: the engine loop thread appends, the endpoint's loop drains.

    FINAL once (later calls dropped); ``is_cancelled`` is True once the stream was cancelled or FINAL queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[ResponseChunk | Delta, bool]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        self.cancelled = False
        self.ready = asyncio.Event()   # set on the loop thread when something is pending

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self._put(chunk, final)

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._put(Delta.failure(message, kind), True)

    def close(self) -> None:
        self._put(Delta(final=True), True)

    def is_cancelled(self) -> bool:
        return self.cancelled or self._closed

    def _put(self, item: ResponseChunk | Delta, final: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = final
            self._pending.append((item, final))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:   # the endpoint's loop is closed: the stream is gone with it
            pass

    def _wake(self) -> None:
        with self._lock:
            self._scheduled = False
        self.ready.set()

    def drain(self) -> list[tuple[Delta, bool]]:
        """Loop thread: the pending responses as deltas, consecutive non-final chunks merged into one."""
        self.ready.clear()
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
        out: list[tuple[Delta, bool]] = []
        merged: ResponseChunk | None = None
        for item, final in items:
            if isinstance(item, ResponseChunk):
                merged = item if merged is None else merge_chunks(merged, item)
                if not final:
                    continue
                item, merged = merged, None
            if merged is not None:
                out.append((_child_delta(merged), False))
                merged = None
            delta = _child_delta(item) if isinstance(item, ResponseChunk) else item
            out.append((delta, final))
        if merged is not None:
            out.append((_child_delta(merged), False))
        return out


class _Draining(Exception):
    """A stream that arrived while the endpoint drains (its model is being unloaded)."""


def _child_delta(chunk: ResponseChunk) -> Delta:
    """A child response's one sample, as the child codec carries it (no client-only new-token count)."""
    return replace(chunk.samples[0], num_new_tokens=0) if chunk.samples else Delta()


class WorkerEndpoint:
    """A PD worker's own gRPC endpoint (module docstring). ``bind`` (the port is known at once), then ``start``
    with the worker, ``stop`` once the worker stopped (its requests' last responses are flushed first).

    Args:
        host: the address to bind and advertise (the host of the worker's ``grpc_url``).
        port: 0 for a free one.
        model_name: the only model this endpoint answers for.
        fleet_secret: HMAC key of stream signatures (``bootstrap.auth``); None: loopback only.
    Raises (``bind``):
        AuthError: ``host`` is not loopback and no fleet secret is set.
        OSError: the port cannot be bound.
    """

    def __init__(self, host: str, port: int, model_name: str, fleet_secret: bytes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._host, self._port, self._model_name = host, port, model_name
        self._secret = fleet_secret
        self._clock = clock
        self._guard = _ReplayGuard(30.0)
        self._worker: ChildWorker | None = None
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._stop_lock = threading.Lock()
        self._active = 0          # streams whose request was handed to the worker and has not ended (loop thread)
        self._draining = False

    @property
    def address(self) -> str:
        """``host:port`` routers reach it at (after ``bind``)."""
        return f"{self._host}:{self._port}"

    def bind(self) -> WorkerEndpoint:
        check_bind(self._host, self._secret, "the worker endpoint")
        self._thread = threading.Thread(target=self._loop.run_forever, name="worker-endpoint", daemon=True)
        self._thread.start()
        try:
            self._port = asyncio.run_coroutine_threadsafe(self._bind(), self._loop).result(30)
        except BaseException:   # a failed load: no thread of this endpoint may outlive it
            self.stop(0)
            raise
        self._thread.name = f"worker-endpoint-{self._port}"
        return self

    def start(self, worker: ChildWorker) -> None:
        """Serve ``worker``'s requests from now on."""
        self._worker = worker
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(30)
        logger.info("worker endpoint of %s at %s", self._model_name, self.address)

    @property
    def num_active(self) -> int:
        """Streams whose request the worker is serving now."""
        return self._active

    def drain(self, timeout_s: float) -> int:
        """A model unload: new streams are answered with an ``INSTANCE`` error (the router retries them
        elsewhere); waits up to ``timeout_s`` seconds for the streams in flight to end, as tritonserver waits for
        a model's own requests before ``finalize``. Returns how many are still open (``stop`` then ends them).
        Any thread."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._active

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: streams still open get ``grace_s`` seconds to send what is queued (their FINAL), then
        are cancelled; the loop thread ends. Idempotent and thread-safe (a second caller waits for the first)."""
        with self._stop_lock:
            if self._thread is None:
                return
            if self._server is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(grace_s + 5)
                except Exception:
                    logger.exception("worker endpoint %s: stop failed", self.address)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._thread = None

    async def _bind(self) -> int:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        servicer = _Servicer(self)
        # tritonserver's keepalive policy is stricter; routers ping every 300 s (launch.GrpcLauncher)
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20),
                                                ("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port(f"{self._host}:{self._port}")
        if port == 0:
            raise OSError(f"the worker endpoint cannot bind {self._host}:{self._port}")
        return port

    def _authenticate(self, metadata: tuple[tuple[str, str | bytes], ...], request_id: str) -> None:
        """Raises ``AuthError`` when a fleet secret is set and the stream's signature is missing or wrong."""
        if self._secret is None:
            return
        header = next((str(v) for k, v in metadata if k == AUTH_METADATA), None)
        now = self._clock()
        verify_call(self._secret, request_id, header, now)
        self._guard.admit(header or "", now)

    async def serve(self, requests: AsyncIterator[service_pb2.ModelInferRequest],
                    metadata: tuple[tuple[str, str | bytes], ...]
                    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """One stream: its first request, answered until FINAL (module docstring)."""
        request = None
        async for request in requests:
            break
        if request is None:
            return
        request_id = request.id
        sink = _StreamSink(asyncio.get_running_loop())
        self._active += 1

        def start() -> None:
            if self._draining:
                raise _Draining(f"{self._model_name} at {self.address} is being unloaded")
            self._start(request, metadata, sink)

        start_or_fail(start, sink, request_id, refusals=(AuthError, _Draining))
        extra = asyncio.ensure_future(self._refuse_more(requests, request_id))
        try:
            while True:
                await sink.ready.wait()
                for delta, final in sink.drain():
                    yield response_message(delta, final, self._model_name, request_id)
                    if final:
                        return
        finally:
            sink.cancelled = True   # cancelled by the router (or the server stopping): the worker aborts it
            self._active -= 1
            extra.cancel()

    def _start(self, request: service_pb2.ModelInferRequest, metadata: tuple[tuple[str, str | bytes], ...],
               sink: _StreamSink) -> None:
        self._authenticate(metadata, request.id)
        if request.model_name != self._model_name:
            raise RequestError("model_name", f"this endpoint serves {self._model_name!r}, not "
                                             f"{request.model_name!r}")
        if self._worker is None:
            raise RuntimeError("the worker endpoint is not serving yet")
        arrays = request_arrays(request)
        if CONTROL_INPUT in arrays:
            raise RequestError(CONTROL_INPUT, "is answered by the model through tritonserver, not here")
        llm = {name: arrays[name] for name in INPUT_NAMES if name in arrays}
        from serving.triton.io import scalars_from_arrays   # numpy only (no pb_utils)

        pd = parse_pd_request(scalars_from_arrays(llm), {n: arrays[n] for n in PD_INPUT_NAMES if n in arrays})
        self._worker.handle(pd, sink)

    async def _refuse_more(self, requests: AsyncIterator[Any], request_id: str) -> None:
        """Reads the rest of the stream's requests (a router sends one, then half-closes at FINAL): one more is
        logged and ignored (the stream answers its first request only)."""
        async for extra in requests:
            logger.warning("request %r: a second request (%r) on one endpoint stream ignored", request_id,
                           extra.id)


def _servicer_base() -> type:
    from tritonclient.grpc import service_pb2_grpc

    return service_pb2_grpc.GRPCInferenceServiceServicer


class _Servicer(_servicer_base()):   # type: ignore[misc]
    """Triton's gRPC service with ``ModelStreamInfer`` only (every other method: UNIMPLEMENTED)."""

    def __init__(self, endpoint: WorkerEndpoint) -> None:
        self._endpoint = endpoint

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        # an async generator function itself: grpc.aio runs a plain function's result as a sync generator
        async for response in self._endpoint.serve(request_iterator, tuple(context.invocation_metadata() or ())):
            yield response
