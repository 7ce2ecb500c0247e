"""Child frames: the wire between a router and a PD worker's own endpoint, both sides in one module.

Why not gRPC here: grpc.aio hands every event from its completion-queue poller thread to the asyncio loop
through a socket, so each message crosses one more thread than the bytes need; measured between two Python
processes on this host (``scripts/perf/bench_child_hop.py``), one child call (open a stream, one request, the
first response) took 549 us over grpc.aio and 86 us over a plain asyncio TCP connection, and each streamed
response cost the receiver 80 us of CPU against 6 us. A PD request's first token crosses this hop twice
(router → prefill → router) and every streamed token once (decode → router). The messages stay Triton's
(``tritonclient.grpc.service_pb2``: ``ModelInferRequest`` in, ``ModelStreamInferResponse`` out, raw contents,
``triton_final_response`` on the last), so ``serving.child.codec`` and both sides' encoders are the same as
through tritonserver; only the framing around them is ours.

One TCP connection per (router, endpoint) carries any number of child streams:

- The router opens the connection with ``PREAMBLE`` (a magic and the frame version); an endpoint that reads
  anything else closes the connection (a router of another build then fails its calls with "connection
  closed", as a wrong port would).
- Every message is a frame: ``HEADER`` (payload bytes: u32, kind: u8, stream id: u32, little-endian), then the
  payload. ``MAX_FRAME_BYTES`` bounds a payload; a larger one is a protocol error that closes the connection.
- ``OPEN`` (router → endpoint): a new stream; payload = u16 length + the fleet signature
  (``signing.sign_call``: bound to the target instance and to the request's model, id and inputs; empty
  without a fleet secret), then the serialized ``ModelInferRequest``. One request per stream; an ``OPEN`` for
  a stream id already open is ignored (logged).
- ``CANCEL`` (router → endpoint, empty payload): the router closed the stream before its FINAL; the worker
  aborts the request (its ``is_cancelled`` turns true).
- ``RESPONSE`` (endpoint → router): one serialized ``ModelStreamInferResponse``; the one with
  ``triton_final_response`` ends the stream.
- The connection closing (either side, or the network) ends every stream on it: the router fails them with
  ``ChildUnavailable``; the endpoint cancels them.

Stream ids are the router's (unique per connection, never reused on it). Everything here is encoding, plus the
connections' TCP keepalive (``keepalive``): callers are the router's event loop thread
(``serving.router.launch.EndpointLauncher``) and the endpoint's loop thread (``serving.workers.endpoint``).
"""

from __future__ import annotations

import asyncio
import enum
import struct

#: What a router sends first on every connection: a magic and the frame version (the last byte)
PREAMBLE = b"PDCHILD\x01"
#: payload bytes (u32), kind (u8), stream id (u32)
HEADER = struct.Struct("<IBI")
_AUTH_LENGTH = struct.Struct("<H")
#: Largest payload accepted (a request with a 128k-token prompt's ids is ~0.5 MiB)
MAX_FRAME_BYTES = 64 * 2**20


class FrameKind(enum.IntEnum):
    OPEN = 1
    CANCEL = 2
    RESPONSE = 3


class FrameError(Exception):
    """A frame that breaks the protocol (unknown kind, oversized, a malformed ``OPEN``): the connection is
    closed."""


def frame(kind: FrameKind, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes. Raises ``FrameError`` for a payload over ``MAX_FRAME_BYTES``."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a {len(payload)}-byte frame is over the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(len(payload), kind, stream_id) + payload


def open_payload(signature: str, request: bytes) -> bytes:
    """``OPEN``'s payload: the fleet signature (ASCII, may be empty) and the serialized request."""
    sig = signature.encode("ascii")
    return _AUTH_LENGTH.pack(len(sig)) + sig + request


def split_open(payload: bytes) -> tuple[str | None, bytes]:
    """The inverse of ``open_payload``: (signature or None when empty, serialized request). Raises
    ``FrameError`` when the signature's length runs past the payload or is not ASCII."""
    if len(payload) < _AUTH_LENGTH.size:
        raise FrameError("an OPEN frame without its signature length")
    (n,) = _AUTH_LENGTH.unpack_from(payload)
    end = _AUTH_LENGTH.size + n
    if end > len(payload):
        raise FrameError("an OPEN frame's signature runs past its payload")
    try:
        signature = payload[_AUTH_LENGTH.size:end].decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("an OPEN frame's signature is not ASCII") from None
    return signature or None, payload[end:]


async def read_frame(reader: asyncio.StreamReader) -> tuple[FrameKind, int, bytes]:
    """The next frame: (kind, stream id, payload). Raises ``asyncio.IncompleteReadError`` at the end of the
    connection and ``FrameError`` for an unknown kind or an oversized payload."""
    size, kind, stream_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a {size}-byte frame is over the {MAX_FRAME_BYTES}-byte limit")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    return frame_kind, stream_id, (await reader.readexactly(size) if size else b"")


#: TCP keepalive of every child connection (seconds): idle before the first probe, between probes, probes. A
#: peer host that vanished without a FIN or RST (a partition, a powered-off host) is found within ~60 s even
#: while no stream waits on it; a stream that waits is ended sooner by the router's
#: ``request_idle_timeout_s``.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


def keepalive(writer: asyncio.StreamWriter) -> None:
    """Turns TCP keepalive on for ``writer``'s socket (``KEEPALIVE_*``; Linux's per-socket options where the
    platform has them). Best effort: a socket that refuses an option keeps the system's."""
    import socket

    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass
