"""Benchmark: KV of 128-, 1k- and 4k-token prompts (SmolLM2 layout, page_size 16) moved from a prefill process
to a decode process over NIXL, against a plain memcpy of the same bytes in the same run.

Usage: python scripts/bench_kv_transfer.py [--backend nixl] [--reps 20] [--scatter]
Prints one line per size, then a JSON object (last line) with kv4k_gbps, memcpy_gbps, kv4k_ratio,
kv128_latency_ms, kv128_overhead_ms, ... Latency is from ``send(is_last=True)`` in the prefill process to the
receiver's ``Success`` in the decode process (CLOCK_MONOTONIC is shared by processes); overhead is latency
minus the memcpy time of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bootstrap import BootstrapServer, ServerConfig  # noqa: E402
from kv_transfer import AuxData, KVArgs, KVLayout, KVPoll, make_kv_manager  # noqa: E402

PAGE_SIZE = 16
SIZES_TOKENS = (128, 1024, 4096)
NUM_PAGES = 4096 // PAGE_SIZE + 8


def smollm2_layout(num_pages: int) -> KVLayout:
    return KVLayout(num_layers=30, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=3, head_dim=64)


def _wait(pred, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():  # the serving layer polls once per engine tick; sleeping here leaves the GIL to the
        if time.monotonic() > deadline:  # manager thread, as an engine forward (which releases it) would
            return False
        time.sleep(0.00005)
    return True


def worker(role: str, url: str, backend: str, conn) -> None:  # type: ignore[no-untyped-def]
    """One engine-like process: a KV pool (touched), a manager, commands from the pipe."""
    layout = smollm2_layout(NUM_PAGES)
    pool = np.random.default_rng(1).random(layout.pool_bytes // 4, dtype=np.float32) if role == "prefill" \
        else np.ones(layout.pool_bytes // 4, dtype=np.float32)  # touched: first-touch page faults excluded
    args = KVArgs(instance_id=f"{role}-0", role=role, kv_base_ptr=pool.ctypes.data, kv_nbytes=pool.nbytes,
                  layout=layout, model_id="smollm2-135m", bootstrap_url=url)
    manager = make_kv_manager(args, backend)
    manager.start()
    conn.send("ready")
    rooms: dict = {}
    while True:
        cmd, room, pages = conn.recv()
        if cmd == "stop":
            break
        if cmd == "recv":
            rooms[room] = manager.create_receiver(room, "prefill-0")
            rooms[room].init(pages)
            conn.send(_wait(lambda: rooms[room].poll() >= KVPoll.WaitingForInput, 10))
        elif cmd == "wait":
            ok = _wait(lambda: rooms[room].poll() in (KVPoll.Success, KVPoll.Failed), 30)
            conn.send((time.monotonic(), ok and rooms.pop(room).poll() == KVPoll.Success))
        elif cmd == "send":
            sender = manager.create_sender(room)
            sender.init(len(pages))
            _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, 10)
            time.sleep(0.002)
            t0 = time.monotonic()
            sender.send(pages, True, AuxData(1, -0.1, room))
            _wait(lambda: sender.pages_releasable(), 30)
            conn.send(t0)
    manager.shutdown()


def memcpy_gbps(nbytes: int, reps: int) -> tuple[float, float]:
    """Best-of and median memcpy throughput of ``nbytes`` between touched buffers, GB/s; and median seconds."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    median_s = statistics.median(times)
    return nbytes / median_s / 1e9, median_s


def run(backend: str, reps: int, scatter: bool) -> dict:  # type: ignore[type-arg]
    server = BootstrapServer(ServerConfig(port=0))
    server.start()
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for role in ("prefill", "decode"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(role, server.url, backend, child), daemon=True)
        proc.start()
        pipes[role], procs = parent, procs + [proc]
    for role in pipes:
        assert pipes[role].poll(60) and pipes[role].recv() == "ready"
    result = {"backend": backend, "scatter": scatter}
    rng = np.random.default_rng(2)
    room = 1
    for tokens in SIZES_TOKENS:
        num_pages = tokens // PAGE_SIZE
        page_bytes = smollm2_layout(NUM_PAGES).page_bytes
        nbytes = num_pages * page_bytes
        lat = []
        for rep in range(reps + 2):
            src = list(range(num_pages)) if not scatter else rng.permutation(NUM_PAGES)[:num_pages].tolist()
            dst = list(range(4, 4 + num_pages)) if not scatter else rng.permutation(NUM_PAGES)[:num_pages].tolist()
            pipes["decode"].send(("recv", room, dst))
            assert pipes["decode"].poll(30) and pipes["decode"].recv()
            pipes["decode"].send(("wait", room, None))
            pipes["prefill"].send(("send", room, src))
            assert pipes["prefill"].poll(60)
            t0 = pipes["prefill"].recv()
            assert pipes["decode"].poll(60)
            t1, ok = pipes["decode"].recv()
            assert ok, f"room {room} failed"
            if rep >= 2:  # two warm-up rooms per size
                lat.append(t1 - t0)
            room += 1
        mem_gbps, mem_s = memcpy_gbps(nbytes, 20)
        med = statistics.median(lat)
        key = {128: "kv128", 1024: "kv1k", 4096: "kv4k"}[tokens]
        result.update({f"{key}_bytes": nbytes, f"{key}_gbps": round(nbytes / med / 1e9, 3),
                       f"{key}_latency_ms": round(med * 1e3, 3), f"{key}_p90_latency_ms":
                       round(sorted(lat)[int(0.9 * (len(lat) - 1))] * 1e3, 3),
                       f"{key}_memcpy_gbps": round(mem_gbps, 3),
                       f"{key}_overhead_ms": round((med - mem_s) * 1e3, 3)})
        print(f"{tokens:5d} tokens {nbytes / 2**20:7.1f} MiB: {backend} {nbytes / med / 1e9:6.2f} GB/s "
              f"(median {med * 1e3:.2f} ms, overhead {1e3 * (med - mem_s):.2f} ms) | memcpy {mem_gbps:6.2f} GB/s "
              f"| ratio {nbytes / med / 1e9 / mem_gbps:.2f}", flush=True)
    result["memcpy_gbps"] = result["kv4k_memcpy_gbps"]
    result["kv4k_ratio"] = round(result["kv4k_gbps"] / result["memcpy_gbps"], 3)
    for role in pipes:
        pipes[role].send(("stop", 0, None))
    for proc in procs:
        proc.join(30)
    server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="nixl", choices=("nixl",))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--scatter", action="store_true", help="random, non-contiguous pages on both sides")
    args = parser.parse_args()
    print(json.dumps(run(args.backend, args.reps, args.scatter)))


if __name__ == "__main__":
    main()
