"""``ChannelPool``: the router's connections (gRPC channels to tritonservers, child-frame connections to
worker endpoints: ``serving.router.launch``), one per endpoint, replaced after a connection failure.

A gRPC channel whose server died keeps reconnecting with exponential backoff (1 s, 1.6 s, 2.6 s, ... up to
120 s by default); while it waits, every call on it fails at once with "UNAVAILABLE: failed to connect to all
addresses", so a server restarted on the same address was not reached for 2.7-3.8 s after it was ready; and a
connection that outlived a network partition fails its next call ("Stream removed ... Connection reset by
peer"). Two measures: a call that fails at the transport (``retire``), or an instance the router gave up on
(``retire_endpoint``), takes its channel out of the pool, so the next call to that endpoint opens a fresh
channel, which connects at once; and every channel's reconnect backoff is short
(``serving.triton.control_client.RECONNECT_BACKOFF_MS``), for the streams still open on a channel when its
server comes back.
A retired channel is closed once its last stream ended (closing it earlier would cancel streams that may still
be served). Everything runs on the router's event loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.triton.control_client import fast_reconnect_args
from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)


@dataclass
class Channel:
    """One pooled client.

    Attributes:
        endpoint: ``host:port``.
        client: a ``GrpcClient`` (``stub.ModelStreamInfer``, ``close()``).
        streams: calls open on it now.
        retired: taken out of the pool; closed when ``streams`` drops to 0.
    """

    endpoint: str
    client: Any
    streams: int = 0
    retired: bool = False


class ChannelPool:
    """gRPC clients by endpoint; ``acquire``/``release`` around every call, ``retire`` after a transport
    failure, ``retire_endpoint`` when the router lost touch with an instance."""

    def __init__(self, keepalive_s: float = 300.0,
                 connect: Callable[[str, list[tuple[str, int]]], Any] | None = None,
                 tls: GrpcTls | None = None) -> None:
        """
        Args:
            keepalive_s: keepalive ping interval (300 s: tritonserver's default ping policy answers more
                frequent pings, or pings on a channel without calls, with GOAWAY ``too_many_pings``); a ping
                unanswered for 20 s fails the channel's streams.
            connect: (endpoint, channel args) → client; default: ``GrpcClient.connect`` (an asyncio channel).
            tls: TLS of the default ``connect``'s channels (tritonservers with ``--grpc-use-ssl``); None:
                plaintext.
        """
        self._keepalive_ms = int(keepalive_s * 1000)
        self._connect = connect or functools.partial(GrpcClient.connect, tls=tls)
        self._channels: dict[str, Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def channel_args(self) -> list[tuple[str, int]]:
        """Options of every channel: tritonclient's message size limits, our keepalive, a short reconnect
        backoff."""
        from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

        return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.keepalive_time_ms", self._keepalive_ms), ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 2),
                # a short backoff, and a new channel never inherits the backoff of a retired one
                *fast_reconnect_args()]

    def acquire(self, endpoint: str) -> Channel:
        """The pooled channel of ``endpoint`` (opened when there is none), its stream count raised by one."""
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = Channel(endpoint, self._connect(endpoint, self.channel_args()))
            self._channels[endpoint] = channel
        channel.streams += 1
        return channel

    def release(self, channel: Channel) -> None:
        """One call on ``channel`` ended; a retired channel is closed after its last call."""
        channel.streams -= 1
        if channel.retired and channel.streams == 0:
            self._close_later(channel)

    def _close_later(self, channel: Channel) -> None:
        task = asyncio.get_running_loop().create_task(_close(channel))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def retire(self, channel: Channel) -> None:
        """A call on ``channel`` failed at the transport: the next call to its endpoint opens a new
        channel."""
        if self._channels.get(channel.endpoint) is channel:
            del self._channels[channel.endpoint]
            logger.info("connection to %s reset after a failure", channel.endpoint)
        channel.retired = True

    def retire_endpoint(self, endpoint: str) -> None:
        """``retire`` the pooled channel of ``endpoint``, if there is one."""
        channel = self._channels.get(endpoint)
        if channel is not None:
            self.retire(channel)
            if channel.streams == 0:
                self._close_later(channel)

    async def close(self) -> None:
        """Close every channel (after every call ended)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await _close(channel)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class GrpcClient:
    """One asyncio gRPC channel to a tritonserver and its ``GRPCInferenceService`` stub (generated code that
    tritonclient ships). Event loop thread only."""

    def __init__(self, channel: Any, stub: Any) -> None:
        self.channel = channel   # grpc.aio.Channel
        self.stub = stub         # tritonclient.grpc.service_pb2_grpc.GRPCInferenceServiceStub

    @classmethod
    def connect(cls, endpoint: str, channel_args: list[tuple[str, int]],
                tls: GrpcTls | None = None) -> GrpcClient:
        """A channel to ``endpoint`` (``host:port``) with ``channel_args``, over TLS when ``tls`` is set;
        connects lazily. Raises ``GrpcTlsError`` when a TLS file cannot be read."""
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        if tls is None:
            channel = grpc.aio.insecure_channel(endpoint, options=channel_args)
        else:
            channel = grpc.aio.secure_channel(endpoint, tls.credentials(),
                                              options=[*channel_args, *tls.channel_args()])
        return cls(channel, service_pb2_grpc.GRPCInferenceServiceStub(channel))

    async def close(self) -> None:
        """Closes the channel (its open calls are cancelled)."""
        await self.channel.close()


async def _close(channel: Channel) -> None:
    try:
        await channel.client.close()
    except Exception:   # closing is best effort
        logger.debug("closing the gRPC channel to %s failed", channel.endpoint, exc_info=True)
