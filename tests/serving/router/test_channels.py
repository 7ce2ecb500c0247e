"""GrpcLauncher over ChannelPool: a server that was down and then started on the same port is reached on the
very next call (no reconnect backoff left over), with a minimal gRPC server speaking Triton's streaming
service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from perf.server import free_ports
from tritonclient.grpc import service_pb2_grpc

from serving.router.channels import ChannelPool
from serving.router.fleet import Target
from serving.router.launch import ChildCall, ChildUnavailable, GrpcLauncher

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    return free_ports(1)[0]


class FinalOnly(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's ``ModelStreamInfer`` answering each request with one empty FINAL response."""

    async def ModelStreamInfer(self, requests: AsyncIterator[Any],
                               context: Any) -> AsyncIterator[Any]:  # noqa: N802
        from tritonclient.grpc import service_pb2

        async for request in requests:
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.parameters["triton_final_response"].bool_param = True
            yield service_pb2.ModelStreamInferResponse(infer_response=response)


async def start_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FinalOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def one_call(launcher: GrpcLauncher, port: int) -> list[Any]:
    target = Target("decode@x", "decode", f"127.0.0.1:{port}", "decode")
    call = ChildCall("decode", target, room=7, prefill_instance="", prefill_rendezvous="")
    return [r async for r in launcher.stream(call)]


def test_a_restarted_server_is_reached_on_the_first_call_after_a_failed_one() -> None:
    async def scenario() -> None:
        port = free_port()
        launcher = GrpcLauncher()
        # the server is down: each call fails at once, growing a backoff on an old channel
        for _ in range(3):
            with pytest.raises(ChildUnavailable, match="UNAVAILABLE"):
                await one_call(launcher, port)
        server = await start_server(port)
        try:
            responses = await asyncio.wait_for(one_call(launcher, port), 5.0)
            assert [r.final for r in responses] == [True]
        finally:
            await launcher.close()
            await server.stop(None)

    asyncio.run(scenario())


class NamedClient:
    """A client named in connection order that records its ``close`` in ``closed``."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name = name
        self._closed = closed

    async def close(self) -> None:
        self._closed.append(self.name)


def recording_pool(*names: str) -> tuple[ChannelPool, list[str]]:
    """A ``ChannelPool`` whose n-th connection is a ``NamedClient`` called ``names[n]``; the names closed."""
    closed: list[str] = []
    order = iter(names)
    return ChannelPool(connect=lambda endpoint, args: NamedClient(next(order), closed)), closed


def test_a_retired_channel_is_closed_after_its_last_stream_and_replaced_for_new_ones() -> None:
    async def scenario() -> None:
        pool, closed = recording_pool("first", "second")
        first = pool.acquire("h:1")
        assert pool.acquire("h:1") is first and first.streams == 2
        pool.retire(first)
        pool.release(first)
        await asyncio.sleep(0)
        assert closed == []   # one stream still open on it
        pool.release(first)
        await asyncio.sleep(0)
        assert closed == ["first"]
        second = pool.acquire("h:1")
        assert second is not first and second.streams == 1
        pool.retire(first)   # a late failure on the old channel leaves the new one pooled
        assert pool.acquire("h:1") is second
        await pool.close()
        assert closed == ["first", "second"]

    asyncio.run(scenario())


def test_retire_endpoint_replaces_the_channel_and_closes_it_after_its_streams_or_at_once() -> None:
    async def scenario() -> None:
        pool, closed = recording_pool("busy", "idle", "new")
        busy = pool.acquire("h:1")   # a stream the router gave up on stays open
        idle = pool.acquire("h:2")
        pool.release(idle)
        pool.retire_endpoint("h:1")
        pool.retire_endpoint("h:2")
        pool.retire_endpoint("h:3")   # none: nothing happens
        await asyncio.sleep(0)
        assert closed == ["idle"]
        assert pool.acquire("h:1").client.name == "new"
        pool.release(busy)
        await asyncio.sleep(0)
        assert closed == ["idle", "busy"]
        await pool.close()

    asyncio.run(scenario())
