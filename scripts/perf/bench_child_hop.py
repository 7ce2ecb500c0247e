"""What one router → worker hop costs over grpc.aio against child frames (plain asyncio TCP), same messages.

A server process answers each child stream (one ``ModelInferRequest``) with ``--responses`` small
``ModelStreamInferResponse``s; the client, in this process, opens ``--calls`` streams one after another, as
the router opens a child stream per request. Printed per transport: the first response's round trip p50 (a
child call's share of TTFT), the whole call's p50, and the client's CPU per call and per response (what the
router spends receiving a streamed token). One line per transport, then their ratios, then JSON. Both
transports run in the same invocation, alternating rounds, so the host's load affects both.

    PYTHONPATH=. .venv/bin/python scripts/perf/bench_child_hop.py                      # 1 response per call
    PYTHONPATH=. .venv/bin/python scripts/perf/bench_child_hop.py --responses 100      # streamed tokens

grpc.aio: ``tritonclient.grpc.service_pb2_grpc``'s service and stub (what ``GrpcLauncher`` uses). Child
frames: ``serving.child.frames`` as ``EndpointLauncher`` and ``serving.workers.endpoint`` use it, reduced to
the framing (no worker, no auth).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time


def _response() -> bytes:
    from tritonclient.grpc import service_pb2

    m = service_pb2.ModelStreamInferResponse()
    m.infer_response.model_name, m.infer_response.id = "prefill", "1-prefill"
    out = m.infer_response.outputs.add(name="text_output", datatype="UINT8")
    out.shape.extend([6])
    m.infer_response.raw_output_contents.append(b"hello ")
    return m.SerializeToString()


def _request() -> object:
    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelInferRequest(model_name="prefill", id="1-prefill")
    t = r.inputs.add(name="text_input", datatype="BYTES")
    t.shape.extend([1])
    r.raw_input_contents.append(b"\x02\x00\x00\x00Hi")
    return r


def _grpc_server(port: int, responses: int, ready: mp.synchronize.Event) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    payload = _response()

    class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelStreamInfer(self, requests, context):  # noqa: N802
            async for _ in requests:
                break
            for _ in range(responses):
                yield service_pb2.ModelStreamInferResponse.FromString(payload)

    async def main() -> None:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def _frames_server(port: int, responses: int, ready: mp.synchronize.Event) -> None:
    from tritonclient.grpc import service_pb2

    from serving.child.frames import PREAMBLE, FrameKind, frame, read_frame, split_open

    payload = _response()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(len(PREAMBLE)) == PREAMBLE
        try:
            while True:
                kind, sid, body = await read_frame(reader)
                if kind is FrameKind.OPEN:
                    service_pb2.ModelInferRequest.FromString(split_open(body)[1])
                    for _ in range(responses):
                        writer.write(frame(FrameKind.RESPONSE, sid,
                                           service_pb2.ModelStreamInferResponse.FromString(payload)
                                           .SerializeToString()))
                    await writer.drain()
        except asyncio.IncompleteReadError:
            pass

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port)
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


async def _grpc_calls(port: int, calls: int, responses: int) -> list[tuple[float, float]]:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        ended = asyncio.Event()

        async def requests(ended: asyncio.Event = ended):
            yield _request()
            await ended.wait()

        first = None
        async for _ in stub.ModelStreamInfer(requests()):
            first = first or time.perf_counter() - started
        ended.set()
        out.append((first, time.perf_counter() - started))
    await channel.close()
    return out


async def _frames_calls(port: int, calls: int, responses: int) -> list[tuple[float, float]]:
    from tritonclient.grpc import service_pb2

    from serving.child.frames import PREAMBLE, FrameKind, frame, open_payload, read_frame

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PREAMBLE)
    out = []
    for sid in range(1, calls + 1):
        started = time.perf_counter()
        writer.write(frame(FrameKind.OPEN, sid, open_payload("", _request().SerializeToString())))
        first = None
        for _ in range(responses):
            _, _, body = await read_frame(reader)
            service_pb2.ModelStreamInferResponse.FromString(body)
            first = first or time.perf_counter() - started
        out.append((first, time.perf_counter() - started))
    writer.close()
    return out


def _round(kind: str, port: int, calls: int, responses: int) -> dict[str, float]:
    cpu = time.process_time()
    runner = _grpc_calls if kind == "grpc" else _frames_calls
    samples = asyncio.run(runner(port, calls, responses))[max(1, calls // 10):]   # the first ones warm up
    cpu = time.process_time() - cpu
    return {"first_p50_us": statistics.median(s[0] for s in samples) * 1e6,
            "call_p50_us": statistics.median(s[1] for s in samples) * 1e6,
            "client_cpu_per_call_us": cpu / calls * 1e6,
            "client_cpu_per_response_us": cpu / calls / responses * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--responses", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per transport")
    args = parser.parse_args()
    ready = {k: mp.Event() for k in ("grpc", "frames")}
    ports = {"grpc": 23456, "frames": 23457}
    servers = [mp.Process(target=_grpc_server if k == "grpc" else _frames_server, daemon=True,
                          args=(ports[k], args.responses, ready[k])) for k in ("grpc", "frames")]
    for server in servers:
        server.start()
    for event in ready.values():
        event.wait(30)
    results: dict[str, list[dict[str, float]]] = {"grpc": [], "frames": []}
    for _ in range(args.rounds):
        for kind in ("grpc", "frames"):
            results[kind].append(_round(kind, ports[kind], args.calls, args.responses))
    for server in servers:
        server.terminate()
    summary = {k: {m: statistics.median(r[m] for r in rounds) for m in rounds[0]} for k,
               rounds in results.items()}
    load = os.getloadavg()[0]
    for kind, figures in summary.items():
        print(f"{kind:7s} first response p50 {figures['first_p50_us']:7.0f} us, call p50 "
              f"{figures['call_p50_us']:7.0f} us, client CPU {figures['client_cpu_per_call_us']:7.0f} "
              f"us/call, {figures['client_cpu_per_response_us']:6.1f} us/response (load {load:.1f})")
    g, f = summary["grpc"], summary["frames"]
    print(f"frames / grpc: first response {f['first_p50_us'] / g['first_p50_us']:.2f}x, client CPU per "
          f"response {f['client_cpu_per_response_us'] / g['client_cpu_per_response_us']:.2f}x")
    print(json.dumps({"responses": args.responses, "calls": args.calls, "load": load, **summary}))


if __name__ == "__main__":
    main()
