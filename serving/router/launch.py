"""The ``Launcher`` seam: send one child request (prefill or decode) and stream its responses.

``ChildLauncher`` (the router's) sends a child request to the worker's own endpoint when its target is one
(``serving.workers.endpoint``: ``EndpointLauncher``, child frames over TCP, ``serving.child.frames``), else
to the tritonserver that serves it, whichever server that is (the router's own included): ``GrpcLauncher``,
asyncio gRPC streaming (Triton's ``ModelStreamInfer`` through the service stub tritonclient ships,
``tritonclient.grpc.service_pb2_grpc``). Either way one stream per child request, so that cancelling the
stream cancels exactly that request (the child then sees ``is_cancelled()``, aborts it and frees its pages). A
worker endpoint's stream can also be pushed (``PushLauncher.push``: each response handed to a callback by the
connection's reader task, no task per child stream), which ``ChildStreams`` prefers. Why not BLS for the
router's own server: docs/architecture.md, "Why the router speaks gRPC". Why the stub and not
``tritonclient.grpc.aio.InferenceServerClient.stream_infer``: that client wraps every response in an
``InferResult`` whose ``as_numpy`` scans the outputs once per name; the router reads each child response (one
per streamed token) once, straight from its raw contents (``serving.child.codec.decode_raw_response``): 110 ->
~20 us per response measured here.

Child protocol: ``serving.child.codec`` (inputs, outputs and their types, the response decoder this module
uses, the schema hash ``child_arrays`` sends). A child reports a failure as a FINAL response whose ``error``
(and ``error_kind``) is set. With a fleet secret every child request is signed (``sign_child``: bound to the
target instance and to the request's model, id and inputs) on both paths: in the ``OPEN`` frame to a worker
endpoint, in the request parameter ``pd_fleet_auth`` through tritonserver; the worker refuses a request
without it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from bootstrap.tls import FleetTLS, ssl_module
from serving.child.codec import CHILD_OUTPUTS, SCHEMA_HASH, SCHEMA_INPUT, decode_raw_response
from serving.child.frames import PREAMBLE, FrameError, FrameKind, frame, keepalive, open_payload, read_frame
from serving.child.signing import AUTH_PARAMETER, sign_call
from serving.delta import Delta, ErrorKind
from serving.parsing.request import RawValue
from serving.router.channels import ChannelPool
from serving.router.fleet import Target
from serving.triton.grpc_tls import GrpcTls

if TYPE_CHECKING:
    import ssl

logger = logging.getLogger(__name__)

Room = int
#: Inputs of the client's request that are forwarded as they are to both children.
FORWARDED_INPUTS: tuple[str, ...] = ("text_input", "sampling_parameters", "apply_chat_template")


@dataclass(frozen=True)
class ChildCall:
    """One child request of one attempt.

    Attributes:
        role: ``"prefill"`` or ``"decode"``.
        target: the instance that serves it (and its DP rank, ``Target.dp_rank``, sent as ``dp_rank``).
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
        """The router lost touch with ``endpoint`` (its instance stopped answering): the next call to it opens
        a new connection; streams open on the old one go on until they end."""
        ...

    async def close(self) -> None:
        """Release connections (after every stream ended)."""
        ...


#: Where a pushed child stream's responses go (``PushLauncher.push``), each once, in order, the last one
#: final.
Deliver = Callable[[Delta], None]


@runtime_checkable
class PushLauncher(Launcher, Protocol):
    """A ``Launcher`` that can also hand a child's responses straight to a callback, on the event loop thread,
    as its connection reads them: no task between the socket and the caller (``stream`` needs one to run its
    generator), one loop turn less per streamed token. ``ChildStreams`` uses it where it is offered."""

    def push(self, call: ChildCall, deliver: Deliver) -> asyncio.Future[None] | None:
        """Send ``call``; ``deliver`` gets each response, the last one final (a child that cannot be reached
        or whose stream breaks: one ``ErrorKind.UNREACHABLE`` failure, as ``stream`` raises
        ``ChildUnavailable``). Returns a future done once the final response was delivered; cancelling it
        before that cancels the child request (as closing ``stream``'s iterator does). None: this call has no
        push path (use ``stream``)."""
        ...


def child_arrays(call: ChildCall) -> dict[str, np.ndarray]:
    """The child request's input arrays, by input name (shape ``[1]`` each; ``resume_token_ids`` and
    ``prompt_token_ids``: ``[k]``); ``dp_rank`` when the target has one."""
    arrays: dict[str, np.ndarray] = {}
    for name in FORWARDED_INPUTS:
        if name in call.inputs:
            value = call.inputs[name]
            arrays[name] = (np.array([value], dtype=np.bool_) if isinstance(value, bool) else
                            np.array([value if isinstance(value, bytes) else str(value).encode()],
                                     dtype=np.object_))
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
    if call.target.dp_rank is not None:   # the DP-attention rank the router chose (serving.router.ranks)
        arrays["dp_rank"] = np.array([call.target.dp_rank], dtype=np.int32)
    return arrays


def child_request_id(call: ChildCall) -> str:
    """The request id of ``call``'s child request: ``"<room>-<role>"``."""
    return f"{call.room}-{call.role}"


def sign_child(call: ChildCall, secret: bytes | None, arrays: Mapping[str, np.ndarray] | None = None) -> str:
    """The fleet signature of ``call``'s child request (``signing.sign_call``: for its target instance,
    over its model name, request id and inputs, ``arrays`` or else ``child_arrays(call)``), timestamped now;
    "" without a secret. Once per child stream, never per token (its cost: docs/benchmarks.md, "Fleet
    signatures")."""
    if secret is None:
        return ""
    return sign_call(secret, call.target.instance_id, call.target.model_name, child_request_id(call),
                     child_arrays(call) if arrays is None else arrays, time.time())


def child_request(call: ChildCall, signature: str = "",
                  arrays: Mapping[str, np.ndarray] | None = None) -> Any:
    """The ``ModelInferRequest`` (``tritonclient.grpc.service_pb2``) of ``call``: its inputs
    (``child_arrays``) as raw contents (BYTES as Triton's length-prefixed elements), every ``CHILD_OUTPUTS``
    requested, request id ``child_request_id``, and ``triton_enable_empty_final_response`` so the FINAL flag
    always comes. ``signature`` (``sign_child``; the tritonserver path) goes in the request parameter
    ``pd_fleet_auth`` (``signing.AUTH_PARAMETER``); "": none (a worker endpoint's travels in the stream's
    ``OPEN``). ``arrays``: ``child_arrays(call)`` when the caller has them already."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=call.target.model_name, id=child_request_id(call))
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    if signature:
        request.parameters[AUTH_PARAMETER].string_param = signature
    for name, array in (child_arrays(call) if arrays is None else arrays).items():
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
    ``--grpc-*`` flags. A dead host is noticed sooner by the fleet watcher (its rendezvous stops answering)
    and by ``request_idle_timeout_s``.
    """

    def __init__(self, keepalive_s: float = 300.0, tls: GrpcTls | None = None,
                 fleet_secret: bytes | None = None) -> None:
        """``fleet_secret``: every request carries its signature (``sign_child``) in its ``pd_fleet_auth``
        parameter, which the worker model checks (``serving.workers.child_auth``)."""
        self._channels = ChannelPool(keepalive_s, tls=tls)
        self._secret = fleet_secret

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        import grpc

        arrays = child_arrays(call)
        request = child_request(call, sign_child(call, self._secret, arrays), arrays)
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await ended.wait()   # keep our half open until the child's FINAL: closing it ends the stream

        channel = self._channels.acquire(call.target.endpoint)
        responses = channel.client.stub.ModelStreamInfer(requests())
        finished = False
        try:
            async for response in responses:
                delta = _response_delta(call, response)
                finished = delta.final
                yield delta
                if finished:
                    return
            raise ChildUnavailable(f"{call.role} {call.target.instance_id}: stream ended without FINAL")
        except grpc.RpcError as e:
            # the connection is suspect (a server restarted, a path back after a partition, a reconnect
            # backoff under way): the next call opens a new one
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


class FrameConnection:
    """One TCP connection to a worker endpoint in child frames (``serving.child.frames``), shared by every
    child stream the router opens there; its reader task hands each ``RESPONSE`` to its stream's inbox. Event
    loop thread only. ``ChannelPool`` keeps one per endpoint (``connect`` lazily, ``close``). With
    ``ssl_context`` (``FleetTLS.client_context``) it speaks TLS, checking the worker's certificate against the
    endpoint's host."""

    def __init__(self, endpoint: str, connect_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.endpoint = endpoint
        self._connect_timeout_s = connect_timeout_s
        self._ssl_context = ssl_context
        self._connecting: asyncio.Future[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._inboxes: dict[int, _Inbox] = {}
        self._next_id = 1
        self.lost: str | None = None   # why the connection ended; streams opened after that fail at once

    async def connected(self) -> None:
        """Connects on first use (every stream waits for the same attempt). Raises ``ChildUnavailable`` when
        the endpoint cannot be reached within ``connect_timeout_s``, or the connection was lost."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        await asyncio.shield(self._connecting)
        if self.lost is not None:
            raise ChildUnavailable(self.lost)

    async def _connect(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        host, tls = host.strip("[]"), self._ssl_context
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port), limit=2 * 2**20, ssl=tls,
                                        server_hostname=host if tls is not None else None),
                self._connect_timeout_s)
        except (OSError, ValueError, asyncio.TimeoutError) as e:
            if tls is not None and isinstance(e, (ssl_module().SSLError, ConnectionResetError)):
                # a certificate the fleet's CA did not sign for this host, or a peer that closed the handshake
                self.lost = f"TLS handshake failed: {str(e) or 'connection closed (a plaintext endpoint?)'}"
            else:
                self.lost = f"cannot connect: {str(e) or type(e).__name__}"
            return
        keepalive(writer)
        writer.write(PREAMBLE)
        self._writer = writer
        self._reader_task = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "connection closed by the worker"
        try:
            while True:
                kind, stream_id, payload = await read_frame(reader)
                if kind is not FrameKind.RESPONSE:
                    raise FrameError(f"a {kind.name} frame from a worker")
                inbox = self._inboxes.get(stream_id)
                if inbox is not None:
                    inbox.put(payload)
        except asyncio.IncompleteReadError:
            pass
        except (OSError, FrameError) as e:
            reason = f"connection failed: {e}"
        except asyncio.CancelledError:
            reason = "connection closed by the router"
        finally:
            self._lose(reason)

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        for inbox in self._inboxes.values():
            inbox.put(None)
        if self._writer is not None:
            self._writer.close()

    def open(self, signature: str, request: bytes,
             on_payload: Callable[[bytes | None], None] | None = None) -> tuple[int, _Inbox]:
        """Starts one stream (after ``connected``): its id and the inbox its responses arrive in (None: the
        connection ended); with ``on_payload``, the reader task calls it with each instead. Raises
        ``ChildUnavailable`` when the connection is gone."""
        if self.lost is not None or self._writer is None:
            raise ChildUnavailable(self.lost or "not connected")
        stream_id, self._next_id = self._next_id, self._next_id + 1
        inbox = self._inboxes[stream_id] = _Inbox(on_payload)
        self._writer.write(frame(FrameKind.OPEN, stream_id, open_payload(signature, request)))
        return stream_id, inbox

    async def drain(self) -> None:
        """Waits while the socket's send buffer is full. Raises ``ChildUnavailable`` when the connection
        failed."""
        if self._writer is not None and self.lost is None:
            try:
                await self._writer.drain()
            except ConnectionError as e:
                raise ChildUnavailable(f"connection failed: {e}") from None

    def finish(self, stream_id: int, cancel: bool) -> None:
        """The stream ended (its FINAL read) or, with ``cancel``, was closed early: the worker is told to
        abort it."""
        self._inboxes.pop(stream_id, None)
        if cancel and self.lost is None and self._writer is not None:
            self._writer.write(frame(FrameKind.CANCEL, stream_id))

    async def close(self) -> None:
        """Closes the connection: streams still open on it end with ``ChildUnavailable``; the worker cancels
        them."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        else:
            self._lose("connection closed by the router")
        if self._writer is not None:
            try:
                await self._writer.wait_closed()
            except (OSError, ConnectionError):
                pass


class _Inbox:
    """One stream's responses (serialized, or None when the connection ended), in order: the reader task puts,
    the stream's task gets; or, with ``on_payload``, the reader task hands each to it at once. Event loop
    thread only."""

    def __init__(self, on_payload: Callable[[bytes | None], None] | None = None) -> None:
        self._items: collections.deque[bytes | None] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._on_payload = on_payload

    def put(self, item: bytes | None) -> None:
        if self._on_payload is not None:
            self._on_payload(item)
            return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> bytes | None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class EndpointLauncher:
    """Child requests to workers' own endpoints (``serving.workers.endpoint``) in child frames
    (``serving.child.frames``): one TCP connection per endpoint (``ChannelPool``: a connection that
    failed is replaced, so a restarted worker is reached on the next call), one stream per call. Responses are
    read straight from their raw contents, as ``GrpcLauncher`` reads them."""

    def __init__(self, fleet_secret: bytes | None = None, connect_timeout_s: float = 5.0,
                 tls: FleetTLS | None = None) -> None:
        """``fleet_secret``: every stream carries its signature (``signing.sign_call``), which the endpoint
        checks. ``connect_timeout_s``: a worker whose host does not answer the connection (or the TLS
        handshake) fails the call (the router retries elsewhere) after this many seconds. ``tls``: the
        fleet's TLS setting: every connection speaks TLS and checks the worker's certificate against the
        fleet's CA and the endpoint's host (``bootstrap.tls``); None: plain TCP. Raises ``TLSError`` when the
        CA no longer loads."""
        context = None if tls is None else tls.client_context()   # one per launcher: it caches the CA
        self._connections = ChannelPool(
            connect=lambda endpoint, _args: FrameConnection(endpoint, connect_timeout_s, context))
        self._secret = fleet_secret

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        from tritonclient.grpc import service_pb2

        arrays = child_arrays(call)
        request = child_request(call, arrays=arrays)
        channel = self._connections.acquire(call.target.endpoint)
        if channel.client.lost is not None:   # the worker closed it since (it restarted, say): a new one
            self._connections.retire(channel)
            self._connections.release(channel)
            channel = self._connections.acquire(call.target.endpoint)
        connection: FrameConnection = channel.client
        signature = sign_child(call, self._secret, arrays)
        stream_id = 0
        finished = False
        try:
            try:
                await connection.connected()
                stream_id, inbox = connection.open(signature, request.SerializeToString())
                await connection.drain()
            except ChildUnavailable as e:
                raise ChildUnavailable(f"{call.role} {call.target.instance_id} at {call.target.endpoint} "
                                       f"unreachable: {e}") from None
            while True:
                payload = await inbox.get()
                if payload is None:
                    raise ChildUnavailable(f"{call.role} {call.target.instance_id} at "
                                           f"{call.target.endpoint}: {connection.lost} before the stream's "
                                           "FINAL")
                response = service_pb2.ModelStreamInferResponse.FromString(payload)
                delta = _response_delta(call, response)
                finished = delta.final
                yield delta
                if finished:
                    return
        except ChildUnavailable:
            self._connections.retire(channel)   # the next call opens a new connection
            raise
        finally:
            if stream_id:
                connection.finish(stream_id, cancel=not finished)
            self._connections.release(channel)

    def push(self, call: ChildCall, deliver: Deliver) -> asyncio.Future[None]:
        """``PushLauncher.push``: the same stream as ``stream``, its responses handed to ``deliver`` by the
        connection's reader task."""
        return _PushedStream(self, call, deliver).done

    def reset(self, endpoint: str) -> None:
        self._connections.retire_endpoint(endpoint)

    async def close(self) -> None:
        await self._connections.close()


class _PushedStream:
    """One ``EndpointLauncher.push`` call: connects and opens the stream in a short task, then its responses
    go from the connection's reader straight to ``deliver``; ``done`` ends it (set after the final response,
    or cancelled by the caller: the worker is told to cancel). Event loop thread only."""

    def __init__(self, launcher: EndpointLauncher, call: ChildCall, deliver: Deliver) -> None:
        self._launcher, self._call, self._deliver = launcher, call, deliver
        self._stream_id = 0
        self._finished = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pool = launcher._connections
        self._channel = pool.acquire(call.target.endpoint)
        # the worker closed it since (it restarted, say): a new one
        if self._channel.client.lost is not None:
            pool.retire(self._channel)
            pool.release(self._channel)
            self._channel = pool.acquire(call.target.endpoint)
        self._connection: FrameConnection = self._channel.client
        self._opening: asyncio.Task[None] | None = asyncio.ensure_future(self._open())
        self.done.add_done_callback(self._end)

    def _where(self) -> str:
        return f"{self._call.role} {self._call.target.instance_id} at {self._call.target.endpoint}"

    async def _open(self) -> None:
        try:
            arrays = child_arrays(self._call)
            request = child_request(self._call, arrays=arrays)
            signature = sign_child(self._call, self._launcher._secret, arrays)
            await self._connection.connected()
            if self.done.done():
                return
            self._stream_id, _ = self._connection.open(signature, request.SerializeToString(),
                                                       self._on_payload)
            await self._connection.drain()
        except ChildUnavailable as e:
            self._fail(f"{self._where()} unreachable: {e}")
        except Exception as e:   # a launcher bug fails this child, never the loop (as ``ChildStreams._read``)
            logger.exception("room=%d: %s stream failed", self._call.room, self._call.role)
            if not self.done.done():
                self._deliver(Delta.failure(f"{self._call.role} failed: {e}"))
                self.done.set_result(None)
        finally:
            self._opening = None

    def _on_payload(self, payload: bytes | None) -> None:
        if self.done.done():
            return
        if payload is None:
            self._fail(f"{self._where()}: {self._connection.lost} before the stream's FINAL")
            return
        from tritonclient.grpc import service_pb2

        try:
            delta = _response_delta(self._call, service_pb2.ModelStreamInferResponse.FromString(payload))
        # a malformed response: this child fails, the connection's other streams go on
        except Exception as e:
            self._deliver(Delta.failure(f"{self._call.role} failed: {e}"))
            self.done.set_result(None)   # not finished: ``_end`` cancels it on the worker
            return
        self._finished = delta.final
        self._deliver(delta)
        if delta.final:
            self.done.set_result(None)

    def _fail(self, message: str) -> None:
        """The stream broke or could not start: the connection is retired (the next call opens a new one)."""
        self._launcher._connections.retire(self._channel)
        if not self.done.done():
            self._deliver(Delta.failure(message, ErrorKind.UNREACHABLE))
            self.done.set_result(None)

    def _end(self, _: asyncio.Future[None]) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._stream_id:
            self._connection.finish(self._stream_id, cancel=not self._finished)
        self._launcher._connections.release(self._channel)


class ChildLauncher:
    """The router's ``Launcher``: a target on a worker's own endpoint (``Target.worker_endpoint``) through
    ``EndpointLauncher``, any other (a tritonserver) through ``GrpcLauncher``."""

    def __init__(self, keepalive_s: float = 300.0, fleet_secret: bytes | None = None,
                 grpc_tls: GrpcTls | None = None, fleet_tls: FleetTLS | None = None) -> None:
        self._grpc = GrpcLauncher(keepalive_s, grpc_tls, fleet_secret=fleet_secret)
        self._frames = EndpointLauncher(fleet_secret, tls=fleet_tls)

    def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        return (self._frames if call.target.worker_endpoint else self._grpc).stream(call)

    def push(self, call: ChildCall, deliver: Deliver) -> asyncio.Future[None] | None:
        """A worker endpoint's stream pushed (``EndpointLauncher.push``); None for a tritonserver target."""
        return self._frames.push(call, deliver) if call.target.worker_endpoint else None

    def reset(self, endpoint: str) -> None:
        self._grpc.reset(endpoint)
        self._frames.reset(endpoint)

    async def close(self) -> None:
        await self._grpc.close()
        await self._frames.close()


def _response_delta(call: ChildCall, response: Any) -> Delta:
    """One ``ModelStreamInferResponse`` as a ``Delta`` (an ``error_message``: a failure, final)."""
    if response.error_message:
        return Delta.failure(f"{call.role} {call.target.instance_id}: {response.error_message}")
    result = response.infer_response
    final = result.parameters["triton_final_response"].bool_param
    raw = result.raw_output_contents
    return decode_raw_response({output.name: raw[i] for i, output in enumerate(result.outputs)
                                if i < len(raw)}, final)


def _rpc_message(error: BaseException) -> str:
    details = getattr(error, "details", None)
    code = getattr(error, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return str(error)
