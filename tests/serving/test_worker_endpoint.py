"""``WorkerEndpoint`` with the router's own ``EndpointLauncher``: the child protocol in child frames over a
worker's own endpoint.

The worker here is a scripted ``ChildWorker`` (it answers from its own thread, as an engine loop does); the
live PD tests run the real workers behind it. Invariants: the router reads exactly what the worker sent (text,
ids, counts, errors with their kind) and one FINAL; a stream that fell behind arrives merged, nothing lost;
closing the stream early cancels the worker's request and only it, on a connection other streams share; a bad
or malformed request, another model's name or a missing fleet signature ends that stream with one error and
nothing else; a connection that breaks fails its streams with ``ChildUnavailable`` and cancels them on the
worker, and the next call reconnects; a peer that does not speak child frames is closed out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from serving.delta import Delta, ErrorKind, ResponseChunk
from serving.parsing.pd_request import PDRequest
from serving.parsing.request import RequestError
from serving.router.fleet import Target
from serving.router.launch import ChildCall, EndpointLauncher, child_arrays, child_request
from serving.stream import ResponseSink
from serving.workers.child_auth import NO_AUTH, ChildAuth
from serving.workers.endpoint import WorkerEndpoint, request_arrays

pytestmark = pytest.mark.timeout(60)
SECRET = b"fleet-secret"


class ScriptedWorker:
    """Answers each request with ``script(pd, sink)`` on a thread of its own; records requests and cancels."""

    def __init__(self, script: Callable[[PDRequest, ResponseSink], None]) -> None:
        self.script = script
        self.requests: list[PDRequest] = []
        self.cancelled = threading.Event()

    def handle(self, pd: PDRequest, sink: ResponseSink) -> str:
        self.requests.append(pd)
        threading.Thread(target=self.script, args=(pd, sink), daemon=True).start()
        return str(pd.room)


def tokens(n: int, pause_s: float = 0.0) -> Callable[[PDRequest, ResponseSink], None]:
    def script(pd: PDRequest, sink: ResponseSink) -> None:
        for i in range(n):
            sink.send(ResponseChunk.single(text=f"t{i} ", num_input_tokens=5, num_output_tokens=i + 1,
                                           num_new_tokens=1, token_ids=(100 + i,)), final=False)
            time.sleep(pause_s)
        sink.send(ResponseChunk.single(finish_reason="length", num_input_tokens=5, num_output_tokens=n),
                  final=True)
    return script


def forty_until_cancelled(cancelled: list[int]) -> Callable[[PDRequest, ResponseSink], None]:
    """40 tokens 10 ms apart, ``"<room>.<i> "``; a request that sees its cancel stops and is noted."""
    def script(pd: PDRequest, sink: ResponseSink) -> None:
        for i in range(40):
            if sink.is_cancelled():
                cancelled.append(pd.room)
                return
            sink.send(ResponseChunk.single(text=f"{pd.room}.{i} ", num_output_tokens=i + 1), final=False)
            time.sleep(0.01)
        sink.send(ResponseChunk.single(finish_reason="length", num_output_tokens=40), final=True)
    return script


def slow_until_cancelled(cancelled: threading.Event) -> Callable[[PDRequest, ResponseSink], None]:
    """Room 2 answers ``"again"`` at once; any other streams ``"x"`` every 10 ms until cancelled (then sets
    ``cancelled``)."""
    def script(pd: PDRequest, sink: ResponseSink) -> None:
        if pd.room == 2:   # the call after the break
            sink.send(ResponseChunk.single(text="again", finish_reason="stop",
                                           num_output_tokens=1), final=True)
            return
        for i in range(500):
            if sink.is_cancelled():
                cancelled.set()
                return
            sink.send(ResponseChunk.single(text="x", num_output_tokens=i + 1), final=False)
            time.sleep(0.01)
    return script


def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Polls ``predicate`` every 10 ms until it holds (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def closed_port() -> int:
    """A loopback port nothing listens on."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return int(free.getsockname()[1])


def call_for(endpoint: WorkerEndpoint, model: str = "decode", room: int = 7) -> ChildCall:
    target = Target("decode@x", "decode", endpoint.address, model, worker_endpoint=True)
    return ChildCall("decode", target, room=room, prefill_instance="", prefill_rendezvous="",
                     inputs={"text_input": b"Hello", "sampling_parameters": b'{"max_tokens": 16}'},
                     prompt_token_ids=(1, 2, 3), tokenizer_id="tok")


def run(worker: ScriptedWorker, scenario: Callable[[WorkerEndpoint], object], secret: bytes | None = None,
        model: str = "decode") -> object:
    auth = NO_AUTH if secret is None else ChildAuth(secret, "decode@x")   # call_for's target instance
    endpoint = WorkerEndpoint("127.0.0.1", 0, model, auth).bind()
    endpoint.start(worker)
    try:
        return asyncio.run(scenario(endpoint))   # type: ignore[arg-type]
    finally:
        endpoint.stop(1.0)


async def collect(launcher: EndpointLauncher, call: ChildCall) -> list[Delta]:
    try:
        return [d async for d in launcher.stream(call)]
    finally:
        await launcher.close()


def test_the_router_reads_what_the_worker_sent_and_one_final() -> None:
    worker = ScriptedWorker(tokens(20))
    out = run(worker, lambda ep: collect(EndpointLauncher(), call_for(ep)))
    assert [d.final for d in out].count(True) == 1 and out[-1].final
    assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(20))
    assert sum((d.token_ids for d in out), ()) == tuple(range(100, 120))
    assert out[-1].finish_reason == "length" and out[-1].num_output_tokens == 20
    assert all(d.num_input_tokens == 5 for d in out)
    pd = worker.requests[0]
    assert (pd.room, pd.prompt_token_ids, pd.tokenizer_id,
            pd.request.prompt) == (7, (1, 2, 3), "tok", "Hello")
    assert pd.request.params.max_tokens == 16


def test_a_stream_that_fell_behind_arrives_merged_with_nothing_lost() -> None:
    def burst(pd: PDRequest, sink: ResponseSink) -> None:
        for i in range(200):   # no pause: the endpoint's loop drains several at once
            sink.send(ResponseChunk.single(text=f"{i},", num_output_tokens=i + 1, token_ids=(i,)),
                      final=False)
        sink.send(ResponseChunk.single(finish_reason="stop", num_output_tokens=200), final=True)

    out = run(ScriptedWorker(burst), lambda ep: collect(EndpointLauncher(), call_for(ep)))
    assert "".join(d.text for d in out) == "".join(f"{i}," for i in range(200))
    assert sum((d.token_ids for d in out), ()) == tuple(range(200))
    assert len(out) < 200 and out[-1].final and out[-1].finish_reason == "stop"


def test_closing_the_stream_early_cancels_the_workers_request() -> None:
    def until_cancelled(pd: PDRequest, sink: ResponseSink) -> None:
        for i in range(1000):
            if sink.is_cancelled():
                worker.cancelled.set()
                return
            sink.send(ResponseChunk.single(text="x", num_output_tokens=i + 1), final=False)
            time.sleep(0.01)

    worker = ScriptedWorker(until_cancelled)

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        stream = launcher.stream(call_for(endpoint))
        first = await stream.__anext__()
        assert first.text == "x"
        await stream.aclose()
        await launcher.close()

    run(worker, scenario)
    assert worker.cancelled.wait(5), "the worker never saw the cancel"


def test_errors_keep_their_kind_and_end_the_stream() -> None:
    def fail(pd: PDRequest, sink: ResponseSink) -> None:
        sink.send(ResponseChunk.single(text="a", num_output_tokens=1), final=False)
        sink.send_error("pool exhausted", ErrorKind.INSTANCE)
        sink.send(ResponseChunk.single(text="late"), final=True)   # after FINAL: dropped

    out = run(ScriptedWorker(fail), lambda ep: collect(EndpointLauncher(), call_for(ep)))
    assert [d.text for d in out] == ["a", ""]
    assert out[-1].final and out[-1].error == "pool exhausted" and out[-1].error_kind is ErrorKind.INSTANCE


def test_a_bad_request_another_model_or_no_signature_fails_that_stream_only() -> None:
    worker = ScriptedWorker(tokens(2))

    async def scenario(endpoint: WorkerEndpoint) -> None:
        bad = call_for(endpoint)
        bad = ChildCall(bad.role, bad.target, bad.room, "", "", inputs={"text_input": b"Hi",
                        "sampling_parameters": b'{"max_tokens": -3}'})
        out = await collect(EndpointLauncher(fleet_secret=SECRET), bad)
        assert len(out) == 1 and out[0].final and out[0].error_kind is ErrorKind.REQUEST
        assert "max_tokens" in out[0].error
        other = call_for(endpoint, model="prefill")
        out = await collect(EndpointLauncher(fleet_secret=SECRET), other)
        assert out[0].error_kind is ErrorKind.REQUEST and "serves 'decode'" in out[0].error
        unsigned = await collect(EndpointLauncher(), call_for(endpoint))
        assert len(unsigned) == 1 and "fleet secret" in unsigned[0].error
        wrong = await collect(EndpointLauncher(fleet_secret=b"other"), call_for(endpoint))
        assert "bad signature" in wrong[0].error
        good = await collect(EndpointLauncher(fleet_secret=SECRET), call_for(endpoint))
        assert good[-1].final and not good[-1].error and "".join(d.text for d in good) == "t0 t1 "

    run(worker, scenario, secret=SECRET)
    assert len(worker.requests) == 1   # only the signed, well-formed request reached the worker


def test_request_arrays_read_back_what_the_router_encodes() -> None:
    target = Target("decode@x", "decode", "127.0.0.1:1", "decode")
    call = ChildCall("decode", target, room=2**40, prefill_instance="prefill@h:1",
                     prefill_rendezvous="http://h:2",
                     inputs={"text_input": "héllo", "apply_chat_template": True},
                     prompt_token_ids=(5, 6), tokenizer_id="tok")
    decoded = request_arrays(child_request(call))
    for name, array in child_arrays(call).items():
        np.testing.assert_array_equal(decoded[name], array)
    request = child_request(call)
    request.raw_input_contents[0] = b"\x09\x00\x00\x00ab"   # a length prefix past the end
    with pytest.raises(RequestError, match="text_input"):
        request_arrays(request)


def test_a_non_loopback_endpoint_needs_a_fleet_secret() -> None:
    from bootstrap.auth import AuthError

    with pytest.raises(AuthError, match="worker endpoint"):
        WorkerEndpoint("10.1.2.3", 0, "decode").bind()


def test_drain_lets_open_streams_end_and_refuses_new_ones() -> None:
    worker = ScriptedWorker(tokens(30, pause_s=0.02))

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        stream = launcher.stream(call_for(endpoint, room=1))
        first = await stream.__anext__()
        drained = asyncio.get_running_loop().run_in_executor(None, endpoint.drain, 10.0)
        await asyncio.sleep(0.1)
        refused = [d async for d in launcher.stream(call_for(endpoint, room=2))]
        rest = [d async for d in stream]
        assert await drained == 0 and endpoint.num_active == 0
        assert len(refused) == 1 and refused[0].error_kind is ErrorKind.INSTANCE
        assert "being unloaded" in refused[0].error
        assert "".join(d.text for d in [first, *rest]) == "".join(f"t{i} " for i in range(30))
        assert rest[-1].final and not rest[-1].error
        await launcher.close()

    run(worker, scenario)
    assert [pd.room for pd in worker.requests] == [1]


def test_a_port_in_use_fails_the_bind_and_leaves_no_thread() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = {t.name for t in threading.enumerate()}
        with pytest.raises(OSError):   # EADDRINUSE from the listener's bind
            WorkerEndpoint("127.0.0.1", taken.getsockname()[1], "decode").bind()
        time.sleep(0.2)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("worker-endpoint")
                    and t.name not in before]


def test_streams_share_one_connection_and_a_cancel_ends_only_its_own() -> None:
    cancelled: list[int] = []

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()

        async def whole(room: int) -> str:
            return "".join([d.text async for d in launcher.stream(call_for(endpoint, room=room))])

        doomed = launcher.stream(call_for(endpoint, room=99))
        await doomed.__anext__()
        others = asyncio.gather(*(whole(room) for room in range(8)))
        await asyncio.sleep(0.05)
        await doomed.aclose()
        texts = await others
        assert texts == ["".join(f"{room}.{i} " for i in range(40)) for room in range(8)]
        assert len(launcher._connections._channels) == 1   # one connection carried all nine
        await launcher.close()

    run(ScriptedWorker(forty_until_cancelled(cancelled)), scenario)
    assert until(lambda: bool(cancelled)) and cancelled == [99]


def test_a_broken_connection_fails_its_streams_cancels_them_and_the_next_call_reconnects() -> None:
    from serving.router.launch import ChildUnavailable

    cancelled = threading.Event()

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        stream = launcher.stream(call_for(endpoint, room=1))
        await stream.__anext__()
        channel = launcher._connections._channels[endpoint.address]
        channel.client._writer.transport.abort()   # the connection breaks under the stream (no FIN)
        with pytest.raises(ChildUnavailable, match="before the stream's FINAL"):
            async for _ in stream:
                pass
        assert await asyncio.get_running_loop().run_in_executor(None, cancelled.wait, 5)
        again = [d async for d in launcher.stream(call_for(endpoint, room=2))]
        assert [d.text for d in again] == ["again"] and again[-1].final
        await launcher.close()

    run(ScriptedWorker(slow_until_cancelled(cancelled)), scenario)


def test_an_unreachable_endpoint_fails_the_call_at_once() -> None:

    from serving.router.launch import ChildUnavailable

    port = closed_port()

    async def scenario() -> None:
        launcher = EndpointLauncher(connect_timeout_s=2.0)
        target = Target("decode@x", "decode", f"127.0.0.1:{port}", "decode", worker_endpoint=True)
        call = ChildCall("decode", target, room=1, prefill_instance="", prefill_rendezvous="")
        started = time.monotonic()
        with pytest.raises(ChildUnavailable, match="unreachable: cannot connect"):
            async for _ in launcher.stream(call):
                pass
        assert time.monotonic() - started < 2.0
        await launcher.close()

    asyncio.run(scenario())


def test_a_peer_without_the_preamble_or_with_a_malformed_open_is_refused_and_others_go_on() -> None:
    import struct

    from serving.child.frames import PREAMBLE, FrameKind, frame

    worker = ScriptedWorker(tokens(3))

    async def scenario(endpoint: WorkerEndpoint) -> None:
        host, port = endpoint.address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")   # a gRPC client, say
        assert await asyncio.wait_for(reader.read(), 5) == b""   # closed, nothing answered
        writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(PREAMBLE + frame(FrameKind.OPEN, 1, struct.pack("<H", 40) + b"short"))
        header = await asyncio.wait_for(reader.readexactly(9), 5)
        size, kind, stream_id = struct.unpack("<IBI", header)
        from tritonclient.grpc import service_pb2

        response = service_pb2.ModelStreamInferResponse.FromString(await reader.readexactly(size))
        result = response.infer_response
        assert (kind, stream_id) == (FrameKind.RESPONSE, 1)
        assert result.parameters["triton_final_response"].bool_param
        errors = [bytes(result.raw_output_contents[i]) for i,
                  o in enumerate(result.outputs) if o.name == "error"]
        assert errors and b"malformed child request" in errors[0]
        writer.close()
        launcher = EndpointLauncher()
        good = await collect(launcher, call_for(endpoint))
        assert "".join(d.text for d in good) == "t0 t1 t2 " and good[-1].final

    run(worker, scenario)
    assert len(worker.requests) == 1


def test_a_worker_restarted_on_the_same_port_is_reached_on_the_next_call() -> None:
    async def scenario() -> None:
        launcher = EndpointLauncher()
        first = WorkerEndpoint("127.0.0.1", 0, "decode").bind()
        first.start(ScriptedWorker(tokens(2)))
        call = call_for(first)
        assert [d async for d in launcher.stream(call)][-1].final
        await asyncio.get_running_loop().run_in_executor(None, first.stop, 1.0)
        port = int(first.address.rsplit(":", 1)[1])
        second = WorkerEndpoint("127.0.0.1", port, "decode").bind()
        second.start(ScriptedWorker(tokens(3)))
        try:
            await asyncio.sleep(0.1)   # the old connection's close reaches the router
            out = [d async for d in launcher.stream(call)]
            assert "".join(d.text for d in out) == "t0 t1 t2 " and out[-1].final and not out[-1].error
        finally:
            await launcher.close()
            await asyncio.get_running_loop().run_in_executor(None, second.stop, 1.0)

    asyncio.run(scenario())


def test_a_router_that_stops_reading_gets_every_stream_merged_and_whole_and_others_go_on() -> None:
    """Several streams on one connection whose router reads nothing for a while (the socket's buffers fill and
    the endpoint stops writing to it): once it reads again, each stream's text arrives whole, in fewer
    responses, with one FINAL; a stream on another connection is served meanwhile."""
    from tritonclient.grpc import service_pb2

    from serving.child.frames import PREAMBLE, FrameKind, frame, open_payload, read_frame
    from serving.router.launch import _response_delta

    piece = "y" * 4000

    def big(pd: PDRequest, sink: ResponseSink) -> None:
        for i in range(600):   # 2.4 MB per stream: 7.2 MB, more than the sockets' buffers hold
            sink.send(ResponseChunk.single(text=f"{i}:{piece};", num_output_tokens=i + 1), final=False)
            if i % 50 == 0:
                time.sleep(0.005)
        sink.send(ResponseChunk.single(finish_reason="length", num_output_tokens=600), final=True)

    expected = "".join(f"{i}:{piece};" for i in range(600))

    async def scenario(endpoint: WorkerEndpoint) -> None:
        host, port = endpoint.address.split(":")
        import socket

        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        reader, writer = await asyncio.open_connection(sock=sock, limit=2**14)   # stops reading at 32 KiB
        writer.write(PREAMBLE)
        streams = (1, 2, 3)
        for sid in streams:
            writer.write(frame(FrameKind.OPEN, sid, open_payload("", child_request(call_for(endpoint,
                                                                                         room=sid)).SerializeToString())))
        await writer.drain()
        # meanwhile another router, on its own connection, is served at once
        other = await asyncio.wait_for(collect(EndpointLauncher(), call_for(endpoint, room=9)), 20)
        assert "".join(d.text for d in other) == expected and other[-1].final
        await asyncio.sleep(1.0)   # this router reads nothing: the worker keeps producing
        call = call_for(endpoint)
        deltas: dict[int, list[Delta]] = {sid: [] for sid in streams}
        while not all(d and d[-1].final for d in deltas.values()):
            kind, sid, payload = await asyncio.wait_for(read_frame(reader), 20)
            assert kind is FrameKind.RESPONSE and sid in streams and not (
                deltas[sid] and deltas[sid][-1].final)
            deltas[sid].append(_response_delta(call,
                                               service_pb2.ModelStreamInferResponse.FromString(payload)))
        for sid in streams:
            assert "".join(d.text for d in deltas[sid]) == expected
            assert [d.final
                    for d in deltas[sid]].count(True) == 1 and deltas[sid][-1].finish_reason == "length"
            assert len(deltas[sid]) < 600
        writer.close()

    run(ScriptedWorker(big), scenario)


# -- the push path (``EndpointLauncher.push``, what ``ChildStreams`` uses): the same stream, no task per child
# --

async def pushed(launcher: EndpointLauncher, call: ChildCall) -> list[Delta]:
    out: list[Delta] = []
    await launcher.push(call, out.append)
    return out


def test_push_delivers_what_the_worker_sent_and_one_final() -> None:
    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        outs = await asyncio.gather(*(pushed(launcher, call_for(endpoint, room=r)) for r in range(4)))
        for out in outs:
            assert [d.final for d in out].count(True) == 1 and out[-1].final
            assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(20))
            assert sum((d.token_ids for d in out), ()) == tuple(range(100, 120))
        assert len(launcher._connections._channels) == 1
        await launcher.close()

    run(ScriptedWorker(tokens(20)), scenario)


def test_push_cancelled_early_cancels_the_workers_request_and_only_it() -> None:
    cancelled: list[int] = []

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        doomed_out: list[Delta] = []
        doomed = launcher.push(call_for(endpoint, room=99), doomed_out.append)
        others = asyncio.gather(*(pushed(launcher, call_for(endpoint, room=r)) for r in range(4)))
        while not doomed_out:
            await asyncio.sleep(0.01)
        doomed.cancel()
        outs = await others
        assert ["".join(d.text for d in out) for out in outs] == [
            "".join(f"{r}.{i} " for i in range(40)) for r in range(4)]
        assert not any(d.final for d in doomed_out)
        await launcher.close()

    run(ScriptedWorker(forty_until_cancelled(cancelled)), scenario)
    assert until(lambda: bool(cancelled)) and cancelled == [99]


def test_push_on_a_broken_connection_delivers_one_unreachable_failure_and_the_next_call_reconnects() -> None:
    cancelled = threading.Event()

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        out: list[Delta] = []
        done = launcher.push(call_for(endpoint, room=1), out.append)
        while not out:
            await asyncio.sleep(0.01)
        launcher._connections._channels[endpoint.address].client._writer.transport.abort()
        await asyncio.wait_for(done, 5)
        assert out[-1].final and out[-1].error_kind is ErrorKind.UNREACHABLE
        assert "before the stream's FINAL" in (out[-1].error or "")
        assert [d.final for d in out].count(True) == 1
        assert await asyncio.get_running_loop().run_in_executor(None, cancelled.wait, 5)
        again = await pushed(launcher, call_for(endpoint, room=2))
        assert [d.text for d in again] == ["again"] and again[-1].final
        await launcher.close()

    run(ScriptedWorker(slow_until_cancelled(cancelled)), scenario)


def test_push_to_an_unreachable_endpoint_fails_at_once() -> None:

    port = closed_port()

    async def scenario() -> None:
        launcher = EndpointLauncher(connect_timeout_s=2.0)
        target = Target("decode@x", "decode", f"127.0.0.1:{port}", "decode", worker_endpoint=True)
        started = time.monotonic()
        out = await pushed(launcher,
                           ChildCall("decode", target, room=1, prefill_instance="", prefill_rendezvous=""))
        assert time.monotonic() - started < 2.0
        assert len(out) == 1 and out[0].final and out[0].error_kind is ErrorKind.UNREACHABLE
        assert "unreachable: cannot connect" in (out[0].error or "")
        await launcher.close()

    asyncio.run(scenario())


def test_push_whose_request_cannot_be_built_fails_that_child_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import serving.router.launch as launch

    def broken(call: ChildCall, *args: object, **kwargs: object) -> object:
        raise ValueError("cannot encode")

    async def scenario(endpoint: WorkerEndpoint) -> None:
        launcher = EndpointLauncher()
        monkeypatch.setattr(launch, "child_request", broken)
        out = await asyncio.wait_for(pushed(launcher, call_for(endpoint)), 5)
        assert len(out) == 1 and out[0].final and "cannot encode" in (out[0].error or "")
        monkeypatch.undo()
        good = await pushed(launcher, call_for(endpoint, room=8))
        assert good[-1].final and "".join(d.text for d in good) == "t0 t1 "
        await launcher.close()

    run(ScriptedWorker(tokens(2)), scenario)
