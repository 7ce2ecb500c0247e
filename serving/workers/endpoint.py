"""``WorkerEndpoint``: a PD worker's own endpoint, where routers send its child requests past tritonserver.

Why: through tritonserver a child request and each of its responses cross the server's gRPC frontend and the
python backend's shared-memory queues into and out of the stub, one hand-off between processes (each a wake-up
on a busy host) per direction; PD's first token crosses that path twice more than colocated's
(router -> prefill -> router), and every streamed token once more (decode -> router). The endpoint serves the
same request and response messages (Triton's ``ModelInferRequest`` / ``ModelStreamInferResponse``, from
``tritonclient.grpc.service_pb2``) from inside the worker's own process, over a plain TCP connection in child
frames (``serving.child.frames``: why not gRPC there, and the framing), which the router's
``EndpointLauncher`` speaks. Dynamo's disaggregated workers and SGLang's router reach workers on their own
endpoints the same way. Triton still serves the model as before (a client's requests, the router's
``describe``, plain ``tritonserver`` with no router, a router with ``worker_endpoints`` false).

Protocol: one child request per stream (the router's ``launch.child_request``: ``model_name`` must be this
worker's model, inputs as raw contents; ``serving.child.codec.CHILD_INPUTS``); responses are
``ModelStreamInferResponse``s in the child layout (``serving.child.codec.encode_response``) with
``triton_final_response`` set on the last one, which the router's ``decode_raw_response`` reads. A stream that
fell behind gets its pending responses merged into one (``serving.delta.merge_chunks``), as the Triton path's
response thread does. Cancelling the stream (the router's ``CANCEL``, or its connection closing) cancels the
request: the worker sees ``is_cancelled`` and aborts the room. Another model's name, a bad or malformed input
or a missing fleet signature each end that stream with one FINAL error response; nothing else is touched.

Authentication: with a fleet secret (``bootstrap.auth``), every stream's ``OPEN`` carries the router's
signature of its request (``signing.sign_call``): an HMAC bound to this worker's instance id, the gRPC
method path, a timestamp, a nonce and a digest of the request (model name, request id and every input:
``signing.inputs_digest``). The worker's ``ChildAuth`` (``serving.workers.child_auth``, shared with the
worker's tritonserver path, one replay guard for both) checks it before anything else: a stream whose
signature is missing, stale, already used on either path, or made for another instance or another request (a
captured one put on another prompt or model) is answered with one FINAL ``instance`` error, "unauthenticated
child request: <reason>", and the worker never sees it. Without a secret the endpoint binds loopback only
(``check_bind``). With the fleet's TLS setting (``bootstrap.tls``) the endpoint speaks TLS only (its
certificate must name the advertised host, which routers dial); a plaintext connection fails its handshake and
never reaches a stream.

Threads: the endpoint runs its own asyncio loop on thread ``worker-endpoint-<port>``; the worker's sinks are
fed from the engine loop thread, which wakes the loop once for every stream with something new (``_Outbox``:
one ``call_soon_threadsafe`` per engine step, not one per stream), and the loop writes what they hold to each
router connection in one write (a decode step's tokens of every stream on it in one ``send``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from bootstrap.auth import check_bind
from serving.answering import start_or_fail
from serving.child.codec import CHILD_OUTPUTS, encode_response
from serving.child.frames import PREAMBLE, FrameError, FrameKind, frame, keepalive, read_frame, split_open
from serving.delta import Delta, ErrorKind, ResponseChunk, merge_chunks
from serving.parsing.arrays import scalars_from_arrays
from serving.parsing.pd_request import CONTROL_INPUT, PD_INPUT_NAMES, PDRequest, parse_pd_request
from serving.parsing.request import INPUT_NAMES, RequestError
from serving.stream import ResponseSink
from serving.workers.child_auth import NO_AUTH, ChildAuth

if TYPE_CHECKING:
    from tritonclient.grpc import service_pb2

    from bootstrap.tls import FleetTLS

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
    """The inputs of a ``ModelInferRequest`` sent with raw contents, as numpy arrays by name: ``BYTES`` as an
    object array of ``bytes`` (Triton's length-prefixed elements), ``INT64``/``INT32``/``BOOL``/``UINT8`` as
    their dtype, each reshaped to its declared shape.

    Raises:
        RequestError: naming an input sent without raw contents, of another data type, or whose contents do
            not fit its shape.
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
        # a short buffer, a length past the end, a bad shape
        except (ValueError, IndexError, struct.error) as e:
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


class _Outbox:
    """The hand-off from the engine loop thread to the endpoint's loop, shared by every stream of the
    endpoint: a sink with something new joins ``ready``, and the loop is woken once for all of them (one
    ``call_soon_threadsafe`` per engine step, not one per stream: each is a write to the loop's self-pipe, on
    the engine thread). ``flush`` runs on the loop thread with the sinks that have something pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush: Callable[[list[_StreamSink]], None]) -> None:
        self.loop = loop
        self.lock = threading.Lock()   # every sink's pending and scheduled, and ``ready``
        self._flush = flush
        self._ready: list[_StreamSink] = []
        self._woken = False

    def schedule(self, sink: _StreamSink) -> None:
        """``sink`` has something pending (caller holds ``lock``); any thread."""
        self._ready.append(sink)
        if self._woken:
            return
        self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:   # the endpoint's loop is closed: its streams are gone with it
            pass

    def _run(self) -> None:
        with self.lock:
            sinks, self._ready = self._ready, []
            self._woken = False
        self._flush(sinks)


class _Connection:
    """One router's connection as the flush writes to it (loop thread): the frames of one flush go out in one
    write; while the socket's send buffer is over ``WRITE_HIGH_WATER`` its sinks wait in ``waiting`` (their
    responses merge meanwhile) until ``drain`` brings it down."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.out: list[bytes] = []
        self.waiting: list[_StreamSink] = []
        self.draining = False


#: Bytes in a router connection's send buffer above which the endpoint stops writing responses to it (the
#: router reads slowly: the streams' responses merge until it is below; asyncio's own default high-water mark)
WRITE_HIGH_WATER = 64 * 1024


class _StreamSink:
    """``ResponseSink`` of one endpoint stream: the engine loop thread appends, the endpoint's loop drains (in
    ``WorkerEndpoint._flush``, with every other stream that has something new).

    FINAL once (later calls dropped); ``is_cancelled`` is True once the stream was cancelled or FINAL
    queued."""

    def __init__(self, outbox: _Outbox, connection: _Connection, stream_id: int) -> None:
        self._outbox = outbox
        self.connection = connection
        self.stream_id = stream_id
        self.request_id = ""
        self._pending: collections.deque[tuple[ResponseChunk | Delta, bool]] = collections.deque()
        # in the outbox's ready list or its connection's waiting list (under its lock)
        self._scheduled = False
        self._closed = False
        self.cancelled = False
        self.finished: asyncio.Future[None] = outbox.loop.create_future()   # set once FINAL is written

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self._put(chunk, final)

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._put(Delta.failure(message, kind), True)

    def close(self) -> None:
        self._put(Delta(final=True), True)

    def is_cancelled(self) -> bool:
        return self.cancelled or self._closed

    def _put(self, item: ResponseChunk | Delta, final: bool) -> None:
        with self._outbox.lock:
            if self._closed:
                return
            self._closed = final
            self._pending.append((item, final))
            if not self._scheduled:
                self._scheduled = True
                self._outbox.schedule(self)

    def drain(self) -> list[tuple[Delta, bool]]:
        """Loop thread: the pending responses as deltas, consecutive non-final chunks merged into one."""
        with self._outbox.lock:
            items = list(self._pending)
            self._pending.clear()
            self._scheduled = False
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
    """A PD worker's own gRPC endpoint (module docstring). ``bind`` (the port is known at once), then
    ``start`` with the worker, ``stop`` once the worker stopped (its requests' last responses are flushed
    first).

    Args:
        host: the address to bind and advertise (the host of the worker's ``grpc_url``).
        port: 0 for a free one.
        model_name: the only model this endpoint answers for.
        auth: the worker's check of child request signatures (``ChildAuth``, shared with its tritonserver
            path); without a fleet secret (``NO_AUTH``, the default): no check, loopback only.
        fleet_tls: serve TLS with the fleet's certificate (``bootstrap.tls``); None: plain TCP.
    Raises (``bind``):
        AuthError: ``host`` is not loopback and ``auth`` has no fleet secret.
        OSError: the port cannot be bound.
        TLSError: the TLS files no longer load (``bootstrap.tls``).
    """

    def __init__(self, host: str, port: int, model_name: str, auth: ChildAuth = NO_AUTH,
                 fleet_tls: FleetTLS | None = None) -> None:
        self._host, self._port, self._model_name = host, port, model_name
        self._auth = auth
        self._tls = fleet_tls
        self._worker: ChildWorker | None = None
        self._loop = asyncio.new_event_loop()
        self._outbox = _Outbox(self._loop, self._flush)
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()   # one per router connection (loop thread)
        # ``_wait_drained`` of a slow router (loop thread)
        self._drains: set[asyncio.Task[None]] = set()
        self._stop_lock = threading.Lock()
        # streams whose request was handed to the worker and has not ended (loop thread)
        self._active = 0
        self._draining = False

    @property
    def address(self) -> str:
        """``host:port`` routers reach it at (after ``bind``)."""
        return f"{self._host}:{self._port}"

    def bind(self) -> WorkerEndpoint:
        check_bind(self._host, self._auth.secret, "the worker endpoint")
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
        assert self._server is not None, "bind first"
        asyncio.run_coroutine_threadsafe(self._server.start_serving(), self._loop).result(30)
        logger.info("worker endpoint of %s at %s", self._model_name, self.address)

    @property
    def num_active(self) -> int:
        """Streams whose request the worker is serving now."""
        return self._active

    def refuse_new(self) -> None:
        """From now on new streams are answered with an ``INSTANCE`` error ("... is being unloaded": the
        router retries them elsewhere); the open ones run on. Any thread."""
        self._draining = True

    def drain(self, timeout_s: float) -> int:
        """A model unload: new streams are answered with an ``INSTANCE`` error (the router retries them
        elsewhere); waits up to ``timeout_s`` seconds for the streams in flight to end, as tritonserver waits
        for a model's own requests before ``finalize``. Returns how many are still open (``stop`` then ends
        them). Any thread."""
        self.refuse_new()
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._active

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: streams still open get ``grace_s`` seconds to send what is queued (their FINAL), then
        are cancelled; the loop thread ends. Idempotent and thread-safe (a second caller waits for the
        first)."""
        with self._stop_lock:
            if self._thread is None:
                return
            if self._server is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._stop(grace_s), self._loop).result(grace_s + 10)
                except Exception:
                    logger.exception("worker endpoint %s: stop failed", self.address)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._thread = None

    async def _bind(self) -> int:
        # the listening socket now (the port is known at once), accepting only from ``start`` on
        context = None if self._tls is None else self._tls.server_context()
        self._server = await asyncio.start_server(self._connection, self._host, self._port,
                                                  limit=2 * 2**20, start_serving=False, ssl=context)
        sockets = self._server.sockets
        if not sockets:
            raise OSError(f"the worker endpoint cannot bind {self._host}:{self._port}")
        return int(sockets[0].getsockname()[1])

    async def _stop(self, grace_s: float) -> None:
        assert self._server is not None
        self._server.close()   # no new connections
        deadline = time.monotonic() + grace_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for task in [*self._connections, *self._drains]:
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One router's connection: its ``OPEN``s and ``CANCEL``s (``serving.child.frames``); every stream on
        it is cancelled when it closes."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        streams: dict[int, asyncio.Task[None]] = {}
        peer = writer.get_extra_info("peername")
        try:
            if await reader.readexactly(len(PREAMBLE)) != PREAMBLE:
                logger.warning("worker endpoint %s: a connection from %s that does not speak child frames "
                               "(version %d) closed", self.address, peer, PREAMBLE[-1])
                return
            keepalive(writer)
            connection = _Connection(writer)
            while True:
                kind, stream_id, payload = await read_frame(reader)
                if kind is FrameKind.OPEN:
                    if stream_id in streams:
                        logger.warning("worker endpoint %s: a second OPEN of stream %d from %s ignored",
                                       self.address, stream_id, peer)
                        continue
                    stream = asyncio.ensure_future(self._stream(stream_id, payload, connection))
                    streams[stream_id] = stream
                    stream.add_done_callback(lambda _, sid=stream_id: streams.pop(sid, None))
                elif kind is FrameKind.CANCEL:
                    cancelled = streams.get(stream_id)
                    if cancelled is not None:
                        cancelled.cancel()
                else:
                    raise FrameError(f"a {kind.name} frame from a router")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except FrameError as e:
            logger.warning("worker endpoint %s: connection from %s closed: %s", self.address, peer, e)
        finally:
            for stream in list(streams.values()):
                stream.cancel()   # its sink turns cancelled: the worker aborts the request
            writer.close()
            self._connections.discard(task)

    async def _stream(self, stream_id: int, payload: bytes, connection: _Connection) -> None:
        """One child stream: its request handed to the worker; its responses are written by ``_flush`` until
        FINAL (module docstring)."""
        from tritonclient.grpc import service_pb2

        sink = _StreamSink(self._outbox, connection, stream_id)
        self._active += 1
        try:
            try:
                signature, raw = split_open(payload)
                request = service_pb2.ModelInferRequest.FromString(raw)
            # FrameError, protobuf's DecodeError: this stream's error, not the connection's
            except Exception as e:
                request, signature = None, None
                sink.send_error(f"a malformed child request: {e}", ErrorKind.REQUEST)
            if request is not None:
                sink.request_id = request.id

                def start() -> None:
                    if self._draining:
                        raise _Draining(f"{self._model_name} at {self.address} is being unloaded (draining: "
                                        "its model unloads or its server stops)")
                    self._start(request, signature, sink)

                start_or_fail(start, sink, request.id, refusals=(_Draining,))
            await sink.finished
        finally:
            sink.cancelled = True   # cancelled by the router (or the server stopping): the worker aborts it
            self._active -= 1

    def _flush(self, sinks: list[_StreamSink]) -> None:
        """Loop thread: the pending responses of ``sinks`` written, each connection's in one write (a decode
        step's tokens of every stream on it: one ``send`` instead of one per stream). A connection whose send
        buffer is full keeps its sinks waiting (``_Connection``); a cancelled stream's responses are
        dropped."""
        touched: list[_Connection] = []
        for sink in sinks:
            connection = sink.connection
            if sink.cancelled or connection.writer.is_closing():
                sink.drain()
                continue
            if connection.draining:
                connection.waiting.append(sink)   # still scheduled: ``_put`` does not queue it again
                continue
            for delta, final in sink.drain():
                message = response_message(delta, final, self._model_name, sink.request_id)
                connection.out.append(frame(FrameKind.RESPONSE, sink.stream_id, message.SerializeToString()))
                if final:
                    sink.cancelled = True   # nothing after FINAL
                    if not sink.finished.done():
                        sink.finished.set_result(None)
                    break
            if connection not in touched:
                touched.append(connection)
        for connection in touched:
            if not connection.out:
                continue
            data, connection.out = b"".join(connection.out), []
            connection.writer.write(data)
            if connection.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER \
                    and not connection.draining:
                connection.draining = True
                waiter = asyncio.ensure_future(self._wait_drained(connection))
                self._drains.add(waiter)
                waiter.add_done_callback(self._drains.discard)

    async def _wait_drained(self, connection: _Connection) -> None:
        """The router reads slowly: its sinks wait (merging) until the socket's buffer drained, then flush."""
        try:
            await connection.writer.drain()
        except ConnectionError:
            pass   # the connection is gone: ``_connection`` cancels its streams
        finally:
            connection.draining = False
            waiting, connection.waiting = connection.waiting, []
            if waiting:
                self._flush(waiting)

    def _start(self, request: service_pb2.ModelInferRequest, signature: str | None,
               sink: _StreamSink) -> None:
        arrays = request_arrays(request)
        self._auth.check(signature, request.model_name, request.id, arrays)   # before any work
        if request.model_name != self._model_name:
            raise RequestError("model_name", f"this endpoint serves {self._model_name!r}, not "
                                             f"{request.model_name!r}")
        if self._worker is None:
            raise RuntimeError("the worker endpoint is not serving yet")
        if CONTROL_INPUT in arrays:
            raise RequestError(CONTROL_INPUT, "is answered by the model through tritonserver, not here")
        llm = {name: arrays[name] for name in INPUT_NAMES if name in arrays}

        pd = parse_pd_request(scalars_from_arrays(llm), {n: arrays[n] for n in PD_INPUT_NAMES if n in arrays})
        self._worker.handle(pd, sink)
