"""What TLS (``bootstrap.tls``, ``PD_TLS_*``) costs per request on the fleet's own listeners, plain against
TLS in one run.

A server process holds a plain and a TLS rendezvous (both with the fleet secret: every call signed, as in a
secured fleet) and a plain and a TLS worker endpoint (a scripted worker that answers each child stream with
one FINAL response at once); this process is the client, as a router or a decode instance is. Measured, in
rounds that alternate plain and TLS so that the host's load falls on both:

* rendezvous, kept alive: one signed ``GET /v1/instances`` (``BootstrapClient.list_instances``, the fleet
  watcher's poll) on a session whose connection stays open, as the fleet's clients keep theirs;
* rendezvous, new connection: the same client with its connections dropped before each call (TCP connect, TLS
  handshake, the call), as after an idle connection closed;
* endpoint stream, kept alive: one child stream (open to FINAL) on the router's connection to the worker
  (``EndpointLauncher``: one connection per worker, every stream on it);
* endpoint, new connection: the launcher's connection to the worker dropped before each stream
  (``EndpointLauncher.reset``: connect, handshake, the stream), as after a worker restarted;
* endpoint, streamed tokens: a stream of ``TOKENS`` responses 1 ms apart on the kept connection (each its own
  frame, as decode's tokens are): the client's CPU per response is the per-token cost.

Printed per measure: p50 and p90 latency and the client's CPU per call, plain and TLS, then TLS / plain; then
one JSON line. Certificates: a throwaway CA and an ECDSA P-256 server certificate for 127.0.0.1
(``perf.tls_certs``, the ``openssl`` command).

    PYTHONPATH=. .venv/bin/python scripts/bench_fleet_tls.py [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECRET = b"bench fleet secret"
MEASURES = ("rendezvous_kept_alive", "rendezvous_new_connection", "endpoint_stream_kept_alive",
            "endpoint_new_connection", "endpoint_streamed_tokens")
#: responses of a streamed-tokens call (room ``TOKENS_ROOM``), 1 ms apart
TOKENS = 32
TOKENS_ROOM = 2


class _ScriptedWorker:
    """The worker: one FINAL response per child stream, sent at once from the calling thread; a stream of room
    ``TOKENS_ROOM`` gets ``TOKENS`` responses 1 ms apart from a thread of its own, then FINAL."""

    def handle(self, pd: Any, sink: Any) -> str:
        from serving.delta import ResponseChunk

        def tokens() -> None:
            for i in range(TOKENS):
                sink.send(ResponseChunk.single(text="t", num_output_tokens=i + 1), final=False)
                time.sleep(0.001)
            sink.send(ResponseChunk.single(finish_reason="length", num_output_tokens=TOKENS), final=True)
        if pd.room == TOKENS_ROOM:
            threading.Thread(target=tokens, daemon=True).start()
        else:
            sink.send(ResponseChunk.single(text="ok", finish_reason="stop", num_output_tokens=1), final=True)
        return str(pd.room)


def _serve(tls_env: dict[str, str], ports: Any, stop: Any) -> None:
    """The server process: two rendezvous and two worker endpoints, plain and TLS, until ``stop`` is set."""
    from bootstrap import Rendezvous, RendezvousConfig
    from bootstrap.messages import Registration
    from bootstrap.tls import load_fleet_tls
    from serving.workers.endpoint import WorkerEndpoint

    tls = load_fleet_tls(tls_env)
    found: dict[str, Any] = {}
    servers: list[Any] = []
    rendezvous_list: list[Any] = []
    for name, setting in (("plain", None), ("tls", tls)):
        rendezvous = Rendezvous(RendezvousConfig(port=0, secret=SECRET, tls=setting))
        rendezvous.start()
        rendezvous.register(Registration("p0", "prefill", 1, "p0#1", "", "h", rendezvous_url=rendezvous.url))
        endpoint = WorkerEndpoint("127.0.0.1", 0, "decode", fleet_tls=setting).bind()
        endpoint.start(_ScriptedWorker())
        servers += [rendezvous, endpoint]
        rendezvous_list.append(rendezvous)
        found[name] = (rendezvous.url, endpoint.address)
    ports.put(found)
    while not stop.wait(0.5):   # the owner's load reports keep the registration from expiring
        for rendezvous in rendezvous_list:
            rendezvous.report_load("p0", 1, None)
    for server in servers:
        server.stop()


def _timed(call: Callable[[], None], n: int) -> tuple[list[float], float]:
    """(latency of each of ``n`` calls in s, client CPU per call in s)."""
    latencies: list[float] = []
    cpu_start = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    return latencies, (time.process_time() - cpu_start) / n


def _rendezvous(url: str, tls: Any, n: int, kept_alive: bool) -> tuple[list[float], float]:
    from bootstrap import BootstrapClient

    client = BootstrapClient(url, 5.0, SECRET, tls)
    client.list_instances()   # the connection is open before timing starts

    def one_call() -> None:
        if not kept_alive:
            client.close()   # its connection pools go; the session makes new ones on the next call
        assert client.list_instances()
    try:
        return _timed(one_call, n)
    finally:
        client.close()


def _endpoint(address: str, tls: Any, n: int, kept_alive: bool, room: int = 1) -> tuple[list[float], float]:
    from serving.router.fleet import Target
    from serving.router.launch import ChildCall, EndpointLauncher

    target = Target("decode@x", "decode", address, "decode", worker_endpoint=True)
    call = ChildCall("decode", target, room=room, prefill_instance="", prefill_rendezvous="",
                     inputs={"text_input": b"Hi"})

    async def streams() -> tuple[list[float], float]:
        launcher = EndpointLauncher(tls=tls)
        latencies: list[float] = []
        cpu_start = time.process_time()
        for i in range(n + 1):   # the first one opens the connection: not timed
            if i and not kept_alive:
                launcher.reset(address)   # the next stream opens a new connection (same TLS context)
            start = time.perf_counter()
            deltas = [d async for d in launcher.stream(call)]
            if i:
                latencies.append(time.perf_counter() - start)
            else:
                cpu_start = time.process_time()
            assert deltas[-1].final and not deltas[-1].error, deltas[-1]
        cpu_per_call = (time.process_time() - cpu_start) / n
        await launcher.close()
        return latencies, cpu_per_call

    return asyncio.run(streams())


def _round(urls: dict[str, tuple[str, str]], tls: Any, calls: int) -> dict[str, dict[str, Any]]:
    """One round: every measure, plain then TLS; raw latencies (s) and CPU per call (s)."""
    out: dict[str, dict[str, Any]] = {m: {} for m in MEASURES}
    for name, setting in (("plain", None), ("tls", tls)):
        url, address = urls[name]
        out["rendezvous_kept_alive"][name] = _rendezvous(url, setting, calls, True)
        out["rendezvous_new_connection"][name] = _rendezvous(url, setting, max(calls // 5, 10), False)
        out["endpoint_stream_kept_alive"][name] = _endpoint(address, setting, calls, True)
        out["endpoint_new_connection"][name] = _endpoint(address, setting, max(calls // 5, 10), False)
        out["endpoint_streamed_tokens"][name] = _endpoint(address, setting, max(calls // 10, 10), True,
                                                          TOKENS_ROOM)
    return out


def _summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per measure and variant: p50/p90 latency over every call of every round (us), median CPU per call (us),
    and the TLS / plain ratios of p50 and CPU."""
    summary: dict[str, dict[str, float]] = {}
    for measure in MEASURES:
        figures: dict[str, float] = {}
        for name in ("plain", "tls"):
            latencies = sorted(x for r in rounds for x in r[measure][name][0])
            figures[f"{name}_p50_us"] = statistics.median(latencies) * 1e6
            figures[f"{name}_p90_us"] = latencies[int(0.9 * (len(latencies) - 1))] * 1e6
            figures[f"{name}_cpu_us"] = statistics.median(r[measure][name][1] for r in rounds) * 1e6
        figures["p50_ratio"] = figures["tls_p50_us"] / figures["plain_p50_us"]
        figures["cpu_ratio"] = figures["tls_cpu_us"] / figures["plain_cpu_us"]
        summary[measure] = figures
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="kept-alive calls per variant and round "
                        "(new-connection measures: a fifth of it)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from perf.tls_certs import make_fleet_certs

    from bootstrap.tls import load_fleet_tls

    certs = make_fleet_certs(Path(tempfile.mkdtemp(prefix="bench-tls-")))
    tls = load_fleet_tls(certs.env())
    context = mp.get_context("spawn")
    ports, stop = context.Queue(), context.Event()
    server = context.Process(target=_serve, args=(certs.env(), ports, stop), daemon=True)
    server.start()
    try:
        urls = ports.get(timeout=60)
        rounds = [_round(urls, tls, args.calls) for _ in range(args.rounds)]
    finally:
        stop.set()
        server.join(10)
    summary = _summary(rounds)
    for measure, f in summary.items():
        print(f"{measure:28s} plain p50 {f['plain_p50_us']:7.0f} us p90 {f['plain_p90_us']:7.0f} cpu "
              f"{f['plain_cpu_us']:6.0f} | tls p50 {f['tls_p50_us']:7.0f} us p90 {f['tls_p90_us']:7.0f} cpu "
              f"{f['tls_cpu_us']:6.0f} | tls/plain p50 {f['p50_ratio']:.2f}x cpu {f['cpu_ratio']:.2f}x")
    tokens = summary["endpoint_streamed_tokens"]
    print(f"client CPU per streamed response: plain {tokens['plain_cpu_us'] / (TOKENS + 1):.1f} us, "
          f"tls {tokens['tls_cpu_us'] / (TOKENS + 1):.1f} us")
    load = os.getloadavg()[0]
    print(json.dumps({"calls": args.calls, "rounds": args.rounds, "load_1m": load, **summary}))


if __name__ == "__main__":
    main()
