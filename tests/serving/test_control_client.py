"""control_client: a channel whose server was down for seconds (a router polling its own server while that
server loads) reaches the server within about a second of its start, not after gRPC's default backoff (up to
120 s, ~4 s after a 5 s load); with a minimal gRPC server speaking Triton's ``ServerLive``."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any

import grpc
import pytest
from perf.server import free_ports
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serving.triton.control_client import RECONNECT_BACKOFF_MS, control_client

pytestmark = pytest.mark.timeout(60)


class Live(service_pb2_grpc.GRPCInferenceServiceServicer):
    def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
        return service_pb2.ServerLiveResponse(live=True)


def test_a_server_that_starts_late_is_reached_within_the_short_backoff() -> None:
    port = free_ports(1)[0]
    client = control_client(f"127.0.0.1:{port}")
    server = None
    try:
        # refused for 5 s: gRPC's default backoff would be ~4 s by then
        refused_until = time.monotonic() + 5.0
        while time.monotonic() < refused_until:
            with pytest.raises(Exception, match="UNAVAILABLE"):
                client.is_server_live(client_timeout=0.5)
            time.sleep(0.1)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Live(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        started = time.monotonic()
        while True:
            try:
                if client.is_server_live(client_timeout=0.5):
                    break
            except Exception:
                assert time.monotonic() - started < 3.0, "still refused 3 s after the server started"
                time.sleep(0.05)
        # at most one max backoff (1 s) plus a connect, with room for a loaded CI host
        assert time.monotonic() - started < RECONNECT_BACKOFF_MS[1] / 1000 + 1.0
    finally:
        client.close()
        if server is not None:
            server.stop(None)
