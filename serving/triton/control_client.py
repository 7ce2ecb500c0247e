"""``control_client``: the tritonclient gRPC client every process of ours uses for control calls to a
tritonserver (liveness, model readiness, the repository index, model metadata, ``describe``).

Why not ``tritonclient.grpc.InferenceServerClient(url)`` as it comes: its channel keeps gRPC's default
reconnect backoff (1 s, growing 1.6× per failed attempt up to 120 s), and while it waits every call fails at
once with the last error. A router loads next to its workers, so its first polls of its own server are refused
while the server loads; after a 5-8 s load the channel waited ~4 s between attempts, and the router saw its
workers 1.5 s or more after tritonserver said ready: a request sent at ready failed with "no healthy decode
instance in the fleet" (CI run of stop 30, reproduced here). A shutdown watch whose channel failed once would
likewise miss answers of a live server. The channel here retries every 100 ms at first and at most every
second (``RECONNECT_BACKOFF_MS``; the router's child channels, ``serving.router.channels``, use the same), and
takes its own subchannels (``grpc.use_local_subchannel_pool``) so that it never inherits another channel's
backoff to the same address.

Any thread; a client is used by one thread at a time (tritonclient's sync client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.triton.grpc_tls import GrpcTls

#: (initial, max) reconnect backoff of a channel, ms (gRPC's defaults: 1000, 120000)
RECONNECT_BACKOFF_MS: tuple[int, int] = (100, 1000)


def fast_reconnect_args() -> list[tuple[str, int]]:
    """Channel options for a short reconnect backoff on subchannels of the channel's own."""
    initial_ms, max_ms = RECONNECT_BACKOFF_MS
    return [("grpc.initial_reconnect_backoff_ms", initial_ms), ("grpc.min_reconnect_backoff_ms", initial_ms),
            ("grpc.max_reconnect_backoff_ms", max_ms),
            # a new channel must not inherit the backoff of an older one to the same endpoint: grpc shares
            # subchannels (and their reconnect state) between the channels of a process by default
            ("grpc.use_local_subchannel_pool", 1)]


def control_client(url: str, tls: GrpcTls | None = None) -> Any:
    """A ``tritonclient.grpc.InferenceServerClient`` for ``url`` (``host:port``) with tritonclient's own
    message size limits and keepalive defaults plus ``fast_reconnect_args``, over TLS when ``tls`` is set (a
    server with ``--grpc-use-ssl``); connects lazily (never raises for an unreachable server: its calls do).
    Returns the client (tritonclient is untyped). Raises ``GrpcTlsError`` when a TLS file cannot be read."""
    import tritonclient.grpc as grpcclient

    keepalive = grpcclient.KeepAliveOptions()
    args = [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(keepalive.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            *fast_reconnect_args()]
    if tls is None:
        return grpcclient.InferenceServerClient(url, channel_args=args)
    return grpcclient.InferenceServerClient(url, creds=tls.credentials(),
                                            channel_args=[*args, *tls.channel_args()])
