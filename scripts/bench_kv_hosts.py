"""Benchmark: KV of 128- and 4k-token prompts (SmolLM2 layout) moved between two network hosts of the fleet
harness (``scripts/fleet/netns.py``: a prefill process on one namespace, a decode process on another, a veth
link each on one bridge), against raw TCP on the same link in the same run.

Usage: python scripts/bench_kv_hosts.py [--backend nixl,mooncake] [--reps 10] [--sizes 128,4096]
                                        [--rate-mbit 0] [--local] [--ucx VAR=VALUE ...]
                                        [--ucx-b VAR=VALUE|none ...]

Each KV room is the bench_kv_transfer one (decode publishes its pages, prefill rewrites its source pages as a
forward pass would, sends them as one last chunk; latency from ``send`` at prefill to ``Success`` at decode on
the shared monotonic clock; each worker polls its room as ``fleet.kv_worker._wait`` does, no faster than a
serving engine loop: an end is seen up to 5 % / 1 ms late; NIXL's decode side is progressed by those polls,
its manager thread and NIXL's progress thread, as in serving: ``kv_progress_thread_ms``, its default unless
``PD_KV_PROGRESS_THREAD_MS`` is set for the workers, e.g. ``--ucx-b PD_KV_PROGRESS_THREAD_MS=0`` for an A/B).
Baselines, interleaved with the rooms (same load): a Python socket pair across the same two namespaces moving
the same bytes as one message and waiting for a 1-byte answer (``tcp<size>_ms``: the bytes at the link's TCP
rate plus one round trip; the receiver reads every byte into one cache-resident window, as iperf does), the
streaming rate of that pair (``tcp_stream_gbps``), and the round trip of a 1-byte message (``rtt_ms``); and a
second pair whose receiver lands the bytes at their own offsets of memory advised as the KV pool's is
(``tcp<size>_landed_ms``: the receive copy then writes DRAM, as a KV transfer's must). Ratios: ``kv4k_ratio``
= tcp4k_ms / kv4k_ms (target >= 0.85), ``kv128_overhead_ms`` = kv128_ms - tcp128_ms (target <= 1 ms above the
round trip TCP itself needs); ``*_landed_ratio`` / ``*_landed_overhead_ms``: the same against the landed pair.
``link_bytes_ratio``: bytes the prefill host's link sent during the rooms over the KV bytes (>= 1: they
crossed the veth). ``--local``: the managers without ``network_only`` (UCX may take shared memory/cma between
namespaces; the link then carries almost nothing). ``--rate-mbit``: a ``tc tbf`` limit on the prefill host's
link. ``--ucx-b``: a second prefill/decode pair on two more hosts with other UCX settings, its rooms
interleaved with the first pair's (an A/B under the same load; keys ``b_*``).
Prints one line per size, then a JSON object (last line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet.kv_worker import NUM_PAGES, KVWorker, smollm2_layout  # noqa: E402
from fleet.netns import Fleet, Host, unavailable_reason  # noqa: E402

PAGE_SIZE = 16
TCP_PORT = 5201
# the raw TCP pair: the sink answers every message (8-byte length, then the bytes) with one byte. argv[3]
# "discard": every read lands in the buffer's start, which stays in cache (what iperf does); "land": the bytes
# land at their own offsets of a 256 MiB mapping advised as the KV pool's is (MADV_HUGEPAGE, every page
# touched first: engine/kv_pool.py), so the receive copy writes DRAM as a KV transfer's must. It listens
# before it touches the memory: the source's connection waits in the backlog meanwhile
SINK = """
import mmap, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(); land = sys.argv[3] == 'land'
region = mmap.mmap(-1, 1 << 28, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if land and hasattr(mmap, 'MADV_HUGEPAGE'): region.madvise(mmap.MADV_HUGEPAGE)
zeros = bytes(1 << 21)
for _ in range(len(region) // len(zeros) if land else 1): region.write(zeros)
buf = memoryview(region)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    head = c.recv(8, socket.MSG_WAITALL)
    if len(head) < 8: break
    n = int.from_bytes(head, 'little'); got = 0
    while got < n: got += c.recv_into(buf[got:n] if land else buf[:min(n - got, len(buf))])
    c.sendall(b'k')
"""
SOURCE = """
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload = bytes(1 << 28)
for line in sys.stdin:
    nbytes, reps = map(int, line.split())
    out = []
    for _ in range(reps):
        t0 = time.monotonic(); c.sendall(nbytes.to_bytes(8, 'little'))
        if nbytes: c.sendall(memoryview(payload)[:nbytes])
        c.recv(1); out.append(time.monotonic() - t0)
    print(json.dumps(out), flush=True)
"""


class RawTCP:
    """A socket pair from ``src`` to ``dst`` (two fleet hosts) on ``port``, kept open for the whole run; the
    sink ``"discard"``s the bytes or ``"land"``s them in memory (``SINK``)."""

    def __init__(self, src: Host, dst: Host, sink: str = "discard", port: int = TCP_PORT) -> None:
        dst.popen(["python", "-c", SINK, dst.address, str(port), sink])
        time.sleep(1.5)
        self.proc = src.popen(["python", "-c", SOURCE, dst.address, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)

    def times_s(self, nbytes: int, reps: int) -> list[float]:
        """Seconds of each of ``reps`` messages of ``nbytes`` (up to 256 MiB), each answered by one byte."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{nbytes} {reps}\n".encode())
        self.proc.stdin.flush()
        return [float(t) for t in json.loads(self.proc.stdout.readline())]


# (name, from, to): segments of a room's latency from the sender's and receiver's timestamps (as in
# bench_kv_transfer; t0: ``send`` called, t1: decode saw Success)
SEGMENTS = (("post", "t0", "posted_s"), ("sender_done", "t0", "done_s"), ("notified", "t0", "notified_s"))


def kv_room(prefill: KVWorker, decode: KVWorker, room: int, src: list[int],
            dst: list[int]) -> tuple[float, dict[str, float]]:
    """One room; seconds from ``send`` at prefill to ``Success`` at decode, and the seconds of each
    ``SEGMENTS``. Raises ``RuntimeError``."""
    decode.call("recv", (room, dst, prefill.instance_id, prefill.rendezvous_url), 60)
    decode.post("wait", (room, 60.0))
    sent = prefill.call("send", (room, src, 60.0, True), 90)
    got = decode.call_raw(90)
    if got.state != "Success":
        raise RuntimeError(
            f"room {room}: prefill {sent.state} {sent.failure}; decode {got.state} {got.failure}")
    stamps = {**sent.timings, **got.timings, "t0": sent.t_s}
    return float(got.t_s - sent.t_s), {n: float(stamps[b] - stamps[a]) if stamps.get(b) else float("nan")
                                       for n, a, b in SEGMENTS}


@dataclass
class Pair:
    """A prefill worker on host ``src`` and a decode worker on host ``dst`` with UCX settings ``ucx``; keys of
    its figures start with ``prefix`` ("" for the first pair, "b_" for the ``--ucx-b`` one)."""

    prefix: str
    src: str
    dst: str
    ucx: dict[str, str]
    prefill: KVWorker | None = None
    decode: KVWorker | None = None
    kv: list[float] = field(default_factory=list)
    segs: list[dict[str, float]] = field(default_factory=list)
    link: int = 0


def measure(fleet: Fleet, pairs: list[Pair], tcp: RawTCP, landed: RawTCP, tokens: int, reps: int,
            first_room: int) -> dict[str, Any]:
    """``reps`` rooms per pair after two warm-up rooms, interleaved (a room on each pair, then the same bytes
    over raw TCP discarded, then landed)."""
    pages = tokens // PAGE_SIZE
    nbytes = pages * smollm2_layout().page_bytes
    src, dst = list(range(pages)), list(range(NUM_PAGES - pages, NUM_PAGES))
    raw: list[float] = []
    raw_landed: list[float] = []
    for pair in pairs:
        pair.kv, pair.segs, pair.link = [], [], 0
    for rep in range(reps + 2):   # two warm-up rooms
        for i, pair in enumerate(pairs):   # rooms are unique per prefill instance: one range per pair
            assert pair.prefill is not None and pair.decode is not None
            before = fleet[pair.src].counters().tx_bytes
            kv_s, seg = kv_room(pair.prefill, pair.decode, first_room + 100_000 * i + rep, src, dst)
            if rep >= 2:
                pair.kv.append(kv_s)
                pair.segs.append(seg)
                pair.link += fleet[pair.src].counters().tx_bytes - before
        raw_s, landed_s = tcp.times_s(nbytes, 1)[0], landed.times_s(nbytes, 1)[0]
        if rep >= 2:
            raw.append(raw_s)
            raw_landed.append(landed_s)
    key = {1024: "kv1k", 4096: "kv4k"}.get(tokens, f"kv{tokens}")
    raw_ms, landed_ms = statistics.median(raw) * 1e3, statistics.median(raw_landed) * 1e3
    out: dict[str, Any] = {f"{key}_bytes": nbytes, f"tcp{key[2:]}_ms": round(raw_ms, 3),
                           f"tcp{key[2:]}_gbps": round(nbytes / raw_ms / 1e6, 3),
                           f"tcp{key[2:]}_landed_ms": round(landed_ms, 3)}
    for pair in pairs:
        out.update(summarize(pair, key, nbytes, raw_ms, landed_ms))
    return out


def summarize(pair: Pair, key: str, nbytes: int, raw_ms: float, landed_ms: float) -> dict[str, Any]:
    """The pair's figures for one size against raw TCP's medians (ms): discarded (the targets') and landed."""
    kv_ms = statistics.median(pair.kv) * 1e3
    k = pair.prefix + key
    out = {f"{k}_ms": round(kv_ms, 3), f"{k}_gbps": round(nbytes / kv_ms / 1e6, 3),
           f"{k}_p90_ms": round(sorted(pair.kv)[int(0.9 * (len(pair.kv) - 1))] * 1e3, 3),
           f"{k}_ratio": round(raw_ms / kv_ms, 3), f"{k}_overhead_ms": round(kv_ms - raw_ms, 3),
           f"{k}_landed_ratio": round(landed_ms / kv_ms, 3),
           f"{k}_landed_overhead_ms": round(kv_ms - landed_ms, 3),
           f"{k}_link_bytes_ratio": round(pair.link / (nbytes * len(pair.kv)), 3),
           **{f"{k}_{n}_ms": round(statistics.median(s[n] for s in pair.segs) * 1e3, 3) for n, _,
              _ in SEGMENTS}}
    label = f"[{pair.prefix.rstrip('_') or 'a'}] " if pair.prefix or len(pair.ucx) else ""
    print(f"{label}{key:5s} {nbytes / 2**20:6.1f} MiB: KV {out[k + '_gbps']:.3f} GB/s (median {kv_ms:.2f} "
          f"ms, p90 {out[k + '_p90_ms']:.2f} ms) | raw TCP same bytes {raw_ms:.2f} ms "
          f"({nbytes / raw_ms / 1e6:.3f} GB/s) | ratio {out[k + '_ratio']:.2f} | overhead "
          f"{out[k + '_overhead_ms']:.2f} ms | link/KV bytes {out[k + '_link_bytes_ratio']:.3f} | load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"      raw TCP landing the bytes in memory {landed_ms:.2f} ms: "
          f"ratio {out[k + '_landed_ratio']:.2f}, "
          f"overhead {out[k + '_landed_overhead_ms']:.2f} ms", flush=True)
    print("      median ms from send: " + ", ".join(f"{n} {out[f'{k}_{n}_ms']:.2f}" for n, _, _ in SEGMENTS),
          flush=True)
    return out


def run(backend: str, reps: int, sizes: tuple[int, ...], network_only: bool, rate_mbit: float,
        ucx: dict[str, str], ucx_b: dict[str, str] | None, log_dir: Path) -> dict[str, Any]:
    """One fleet: ``reg`` (unused since the rendezvous moved into the instances), ``pf``/``dc`` (the pair),
    and with ``ucx_b`` ``pf2``/``dc2`` (a second pair with those UCX settings, measured interleaved with the
    first: an A/B under the same load)."""
    result: dict[str, Any] = {"backend": backend, "network_only": network_only, "rate_mbit": rate_mbit,
                              "ucx": ucx, "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    pairs = [Pair("", "pf", "dc", ucx)] + ([Pair("b_", "pf2", "dc2", ucx_b)] if ucx_b is not None else [])
    if ucx_b is not None:
        result["b_ucx"] = ucx_b
    hosts = ["reg"] + [h for pair in pairs for h in (pair.src, pair.dst)]
    with Fleet(hosts) as fleet, open(log_dir / f"bench_kv_hosts-{backend}.log", "w") as log:
        for pair in pairs:
            if rate_mbit:
                fleet[pair.src].throttle(rate_mbit)
            pair.prefill = KVWorker(fleet[pair.src], "prefill", backend, network_only, env=pair.ucx, log=log)
            pair.decode = KVWorker(fleet[pair.dst], "decode", backend, network_only, env=pair.ucx, log=log)
        tcp = RawTCP(fleet["pf"], fleet["dc"])
        landed = RawTCP(fleet["pf"], fleet["dc"], "land", TCP_PORT + 1)
        result["rtt_ms"] = round(statistics.median(tcp.times_s(0, 200)) * 1e3, 4)
        result["tcp_stream_gbps"] = round((1 << 28) / min(tcp.times_s(1 << 28, 3)) / 1e9, 3)
        print(f"link: round trip {result['rtt_ms']:.3f} ms, TCP stream {result['tcp_stream_gbps']:.3f} GB/s",
              flush=True)
        for i, tokens in enumerate(sizes):
            result.update(measure(fleet, pairs, tcp, landed, tokens, reps, 1 + 1000 * i))
        for pair in pairs:
            for worker in (pair.prefill, pair.decode):
                assert worker is not None
                worker.stop()
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="nixl", help="comma-separated: nixl, mooncake")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sizes", default="128,4096",
                        help="prompt lengths in tokens, multiples of 16 (keys kv<tokens>, kv1k, kv4k)")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="tc tbf limit on the prefill link")
    parser.add_argument("--local", action="store_true", help="without network_only (shared memory allowed)")
    parser.add_argument("--ucx", action="append", default=[], help="VAR=VALUE for both workers (repeatable)")
    parser.add_argument("--ucx-b", action="append", default=None,
                        help="VAR=VALUE (repeatable; 'none' for no variable): a second pair with these "
                             "settings, measured interleaved with the first (keys b_*)")
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"bench_kv_hosts: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a TERM (timeout) still tears the fleet down
    ucx = dict(item.split("=", 1) for item in args.ucx)
    sizes = tuple(int(t) for t in args.sizes.split(","))
    ucx_b = None if args.ucx_b is None else dict(i.split("=", 1) for i in args.ucx_b if i != "none")
    results = {b: run(b, args.reps, sizes, not args.local, args.rate_mbit, ucx, ucx_b, Path(args.log_dir))
               for b in args.backend.split(",")}
    print(json.dumps(next(iter(results.values())) if len(results) == 1 else {"backends": results}))


if __name__ == "__main__":
    main()
