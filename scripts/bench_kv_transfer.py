"""Benchmark: KV of 128-, 1k- and 4k-token prompts (SmolLM2 layout, page_size 16) moved from a prefill process
to a decode process over a KV backend (NIXL, Mooncake), against a plain memcpy of the same bytes in the same
run.

Usage: python scripts/bench_kv_transfer.py [--backend nixl,mooncake] [--reps 20] [--scatter]
                                           [--sizes 128,1024,4096] [--cold] [--no-inline]
                                           [--no-huge-pages] [--dtype float32|bfloat16]
``--dtype bfloat16``: the KV of a ``dtype: bfloat16`` engine (half the bytes per page; the pools hold 16-bit
values, which the transfer and the baseline copy as bytes).
The pool is page-major (``kv_transfer.layout`` v2 and later): a page is one contiguous region, so
``--scatter`` (random pages on both sides) moves one descriptor per page instead of merging runs.
Prints one line per size, then a JSON object (last line; with several backends ``{"backends": {name: ...}}``)
with kv4k_gbps, memcpy_gbps, kv4k_ratio, kv4k_ratio_ceiling (against the cached-store ceiling, see
``MemcpyBaseline``), kv4k_ceiling_ratio (that ceiling over memcpy), kv128_latency_ms, kv128_overhead_ms, ...
Latency is from ``send(is_last=True)`` in the prefill process to the receiver's ``Success`` in the decode
process (CLOCK_MONOTONIC is shared by processes); overhead is latency minus the memcpy time of the same bytes.
Per size it also prints the median of each segment of that latency (``kv128_wake_ms`` ...; see ``SEGMENTS``,
from ``sender.timings`` / ``receiver.timings``): medians of parts do not add up to the median of the whole.

Cache state: as in serving, where ``send`` follows the forward pass that wrote the chunk's KV, each room's
source pages are written with fresh values right before ``send``, and the memcpy baseline's source pages right
before its copy (both sources are then in cache, both destinations are not). ``--cold`` instead sleeps 2 ms
before ``send`` with the source untouched since start (and the baseline copies an untouched source): what an
idle prefill instance sees.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_transfer import AuxData, KVArgs, KVLayout, KVPoll, make_kv_manager

PAGE_SIZE = 16
SIZES_TOKENS = (128, 1024, 4096)
NUM_PAGES = 4096 // PAGE_SIZE + 8
#: Threads of the cached-store ceiling (``MemcpyBaseline``): as many as NIXL's copy threads
#: (``kv_transfer.nixl_transport.COPY_THREADS``) where the host has the cores for them.
CEILING_THREADS = 2


#: The KV dtype of every pool and layout of this run (``--dtype``; spawned workers get it as an argument).
KV_DTYPE = "float32"
_NP_DTYPES = {"float32": np.float32, "bfloat16": np.int16}   # numpy has no bfloat16: its bits as int16


def smollm2_layout(num_pages: int, dtype: str | None = None) -> KVLayout:
    return KVLayout(num_layers=30, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=3, head_dim=64,
                    dtype=dtype or KV_DTYPE)


def fill_random(values: np.ndarray, seed: int) -> None:
    """Fresh values in every element of ``values`` (float32, or the int16 bits of bfloat16)."""
    rng = np.random.default_rng(seed)
    if values.dtype == np.float32:
        values[...] = rng.random(values.shape, dtype=np.float32)
    else:
        values[...] = rng.integers(-2**15, 2**15, values.shape, dtype=values.dtype)


def _wait(pred, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():  # the serving layer polls once per engine tick; sleeping here leaves the GIL to the
        if time.monotonic() > deadline:  # manager thread, as an engine forward (which releases it) would
            return False
        time.sleep(0.00005)
    return True


def engine_pool(huge_pages: bool, dtype: str | None = None) -> np.ndarray:
    """A pool allocated as the engine allocates it (``engine.kv_pool.KVPool``: huge pages unless
    ``--no-huge-pages``), as a flat array (float32, or int16 for bfloat16); the pool object lives as long as
    the array."""
    from engine.kv_pool import KVPool, KVShape

    dtype = dtype or KV_DTYPE
    pool = KVPool(KVShape(num_layers=30, num_kv_heads=3, head_dim=64, page_size=PAGE_SIZE), NUM_PAGES,
                  getattr(torch, dtype), "cpu", huge_pages=huge_pages)
    if pool.populating is not None:
        pool.populating.join()   # faulted in before anything is timed
    storage = pool.storage if dtype == "float32" else pool.storage.view(torch.int16)
    return storage.numpy().reshape(-1)   # [pool values]; numpy keeps the tensor (and its memory) alive


def worker(role: str, prefill_url: str, backend: str, cold: bool,
           inline: bool,  # type: ignore[no-untyped-def]
           huge_pages: bool, dtype: str, conn) -> None:
    """One engine-like process: a KV pool (touched), a manager with its own rendezvous, commands from the
    pipe; ``prefill_url``: decode only, the prefill process's rendezvous."""
    layout = smollm2_layout(NUM_PAGES, dtype)
    pool = engine_pool(huge_pages, dtype)   # touched: first-touch page faults excluded
    if role == "prefill":
        fill_random(pool, 1)
    else:
        pool[:] = 1
    forward = ForwardPass(pool.reshape(NUM_PAGES, -1), cold)   # page-major: [num_pages, page floats]
    args = KVArgs(instance_id=f"{role}-0", role=role, kv_base_ptr=pool.ctypes.data, kv_nbytes=pool.nbytes,
                  layout=layout, model_id="smollm2-135m", inline_progress=inline)
    manager = make_kv_manager(args, backend)
    manager.start()
    conn.send(("ready", manager.rendezvous_url))
    serve_commands(manager, conn, prefill_url, forward)
    manager.shutdown()


def serve_commands(manager: object, conn, prefill_url: str,  # type: ignore[no-untyped-def]
                   forward: Callable[[list[int]], None], wait_s: float = 30,
                   extra: dict[str, Callable[[], object]] | None = None) -> None:
    """A worker's command loop until ``stop``: ``recv`` (decode: a receiver of the room's pages, answers once
    it waits for input), ``wait`` (decode: answers (monotonic time, success, timings) once the room ended, at
    most ``wait_s``), ``send`` (prefill: ``send_room`` with ``forward``), and ``extra``'s commands (answered
    with what their function returns)."""
    rooms: dict = {}  # type: ignore[type-arg]
    while True:
        cmd, room, pages = conn.recv()
        if cmd == "stop":
            break
        if cmd == "recv":
            receiver = rooms[room] = manager.create_receiver(room, "prefill-0", prefill_url)  # type: ignore[attr-defined]
            receiver.init(pages)
            conn.send(_wait(lambda r=receiver: r.poll() >= KVPoll.WaitingForInput, 10))
        elif cmd == "wait":
            receiver = rooms.pop(room)
            ok = _wait(lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed), wait_s)
            conn.send((time.monotonic(), ok and receiver.poll() == KVPoll.Success, vars(receiver.timings)))
        elif cmd == "send":
            conn.send(send_room(manager, room, pages, forward))
        elif extra is not None and cmd in extra:
            conn.send(extra[cmd]())


class ForwardPass:
    """What precedes ``send`` in a prefill engine: the forward pass writes the chunk's KV into its pages
    (here: every value of the pages rewritten in place, 5.6 MiB for 128 tokens in float32). ``cold``: an idle
    instance instead (2 ms of sleep, pages untouched)."""

    def __init__(self, kv: np.ndarray, cold: bool) -> None:
        self.kv = kv   # [num_pages, page values] float32 or int16 (page-major pool)
        self.cold = cold

    def __call__(self, pages: list[int]) -> None:
        for s, _ in runs(pages, pages):
            self.touch(self.kv[s])

    def touch(self, values: np.ndarray) -> None:
        if self.cold:
            time.sleep(0.002)
        else:
            np.add(values, values.dtype.type(1), out=values)


def send_room(manager: object, room: int, pages: list[int],
              forward: ForwardPass) -> tuple[float, dict]:  # type: ignore[type-arg]
    """Prefill side of one room: wait for the destination, run ``forward`` over the pages, send every page as
    one last chunk, wait until the WRITE is done; returns the monotonic time of the ``send`` call and the
    sender's timestamps."""
    sender = manager.create_sender(room)  # type: ignore[attr-defined]
    sender.init(len(pages))
    _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, 10)
    forward(pages)
    t0 = time.monotonic()
    sender.send(pages, True, AuxData(1, -0.1, room))
    _wait(sender.pages_releasable, 30)
    return t0, vars(sender.timings)


class MemcpyBaseline:
    """The same bytes copied with a plain memcpy (numpy copyto) between two touched pools in one process, two
    ways: page for page as the transfer moves them (one copy per run of pages), and as one flat copy of the
    same byte count. The faster of the two is the baseline (the harder target). Also timed: one copy per page
    (737,280 bytes each), which stays below glibc's non-temporal threshold (``x86_non_temporal_threshold``,
    114 MiB on this host) and so copies with cached stores, as the kernel's ``process_vm_writev`` does; a
    single copy of a 4k prompt's 180 MiB is above it and streams with non-temporal stores. And the same
    page-for-page copy split between ``CEILING_THREADS`` threads (numpy releases the GIL): the fastest a copy
    with cached stores on as many threads as NIXL's copy threads moves these bytes here, which bounds what
    UCX ``cma`` (a kernel copy with cached stores, openucx/ucx#8227) can reach."""

    def __init__(self, cold: bool, huge_pages: bool) -> None:
        self.src = engine_pool(huge_pages).reshape(NUM_PAGES, -1)   # [pages, page values], as the workers'
        fill_random(self.src, 0)
        self.dst = engine_pool(huge_pages).reshape(NUM_PAGES, -1)
        self.dst[:] = 1
        self.forward = ForwardPass(self.src, cold)

    def seconds(self, src_pages: list[int], dst_pages: list[int]) -> tuple[float, float, float]:
        """(baseline seconds, one-copy-per-page seconds, one copy per page on ``CEILING_THREADS`` threads
        seconds); each source is written first, as for the transfer (``ForwardPass``)."""
        self.forward(src_pages)
        t0 = time.perf_counter()
        for s, d in runs(src_pages, dst_pages):
            np.copyto(self.dst[d.start:d.stop], self.src[s.start:s.stop])
        paged_s = time.perf_counter() - t0
        nfloats = len(src_pages) * self.src.shape[1]
        self.forward.touch(self.src.reshape(-1)[-nfloats:])   # the flat copy's source
        t0 = time.perf_counter()
        np.copyto(self.dst.reshape(-1)[:nfloats], self.src.reshape(-1)[-nfloats:])
        flat_s = time.perf_counter() - t0
        pairs = list(zip(src_pages, dst_pages))
        self.forward(src_pages)
        t0 = time.perf_counter()
        self._copy_pages(pairs)
        page_s = time.perf_counter() - t0
        self.forward(src_pages)
        step = -(-len(pairs) // CEILING_THREADS)
        threads = [threading.Thread(target=self._copy_pages, args=(pairs[i:i + step],))
                   for i in range(0, len(pairs), step)]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return min(paged_s, flat_s), page_s, time.perf_counter() - t0

    def _copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        for s_page, d_page in pairs:
            np.copyto(self.dst[d_page], self.src[s_page])


def runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[slice, slice]]:
    """Maximal runs of pages contiguous on both sides, as (source slice, destination slice)."""
    out: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [(slice(s, s + n), slice(d, d + n)) for s, d, n in out]


# (name, from, to): segments of one room's latency, from the sender's and receiver's timestamps
# (kv_transfer.timings) plus t0 (before ``send``) and t1 (the decode main thread saw Success)
SEGMENTS = (("wake", "t0", "post_start_s"), ("write", "post_start_s", "posted_s"),
            ("notify", "posted_s", "notified_s"), ("complete", "notified_s", "success_s"),
            ("poll", "success_s", "t1"), ("sender_done", "t0", "done_s"))


def transfer_once(pipes: dict, room: int, src: list[int],  # type: ignore[type-arg]
                  dst: list[int]) -> tuple[float, dict]:  # type: ignore[type-arg]
    """One room end to end; returns seconds from ``send(is_last)`` at prefill to ``Success`` at decode, and
    the seconds of each segment of ``SEGMENTS``."""
    pipes["decode"].send(("recv", room, dst))
    assert pipes["decode"].poll(30) and pipes["decode"].recv()
    pipes["decode"].send(("wait", room, None))
    pipes["prefill"].send(("send", room, src))
    assert pipes["prefill"].poll(60)
    t0, sender_times = pipes["prefill"].recv()
    assert pipes["decode"].poll(60)
    t1, ok, receiver_times = pipes["decode"].recv()
    assert ok, f"room {room} failed"
    stamps = {**sender_times, **receiver_times, "t0": t0, "t1": t1}
    return t1 - t0, {name: stamps[b] - stamps[a] for name, a, b in SEGMENTS}


def summarize(key: str, nbytes: int, lat: list[float], mem: list[float], mem_page: list[float],
              mem_ceiling: list[float], segs: list[dict]) -> dict:  # type: ignore[type-arg]
    med, mem_med, page_med = statistics.median(lat), statistics.median(mem), statistics.median(mem_page)
    ceiling_med = statistics.median(mem_ceiling)
    breakdown = {f"{key}_{name}_ms": round(statistics.median(s[name] for s in segs) * 1e3, 3)
                 for name, _, _ in SEGMENTS}
    return {**breakdown, f"{key}_bytes": nbytes, f"{key}_gbps": round(nbytes / med / 1e9, 3),
            f"{key}_latency_ms": round(med * 1e3, 3),
            f"{key}_p90_latency_ms": round(sorted(lat)[int(0.9 * (len(lat) - 1))] * 1e3, 3),
            f"{key}_memcpy_gbps": round(nbytes / mem_med / 1e9, 3), f"{key}_ratio": round(mem_med / med, 3),
            f"{key}_overhead_ms": round((med - mem_med) * 1e3, 3),
            f"{key}_memcpy_page_gbps": round(nbytes / page_med / 1e9, 3),
            f"{key}_ratio_page": round(page_med / med, 3),
            f"{key}_memcpy_ceiling_gbps": round(nbytes / ceiling_med / 1e9, 3),
            f"{key}_ceiling_ratio": round(mem_med / ceiling_med, 3),
            f"{key}_ratio_ceiling": round(ceiling_med / med, 3)}


def start_workers(backend: str, cold: bool, inline: bool,
                  huge_pages: bool) -> tuple[dict, list]:  # type: ignore[type-arg]
    """Prefill, then decode (told prefill's rendezvous URL, as a router tells it in-band)."""
    ctx = mp.get_context("spawn")
    pipes: dict = {}  # type: ignore[type-arg]
    procs: list = []  # type: ignore[type-arg]
    prefill_url = ""
    for role in ("prefill", "decode"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker,
                           args=(role, prefill_url, backend, cold, inline, huge_pages, KV_DTYPE,
                                 child),
                           daemon=True)
        proc.start()
        pipes[role], procs = parent, procs + [proc]
        assert parent.poll(60)
        ready, url = parent.recv()
        assert ready == "ready"
        prefill_url = prefill_url or url
    return pipes, procs


def measure_size(pipes: dict, tokens: int, reps: int, scatter: bool, cold: bool,  # type: ignore[type-arg]
                 first_room: int, huge_pages: bool) -> dict:
    """``reps`` rooms of ``tokens`` tokens (after two warm-up rooms), each followed by the memcpy baseline."""
    rng, baseline = np.random.default_rng(tokens), MemcpyBaseline(cold, huge_pages)
    num_pages = tokens // PAGE_SIZE
    lat, mem, mem_page, mem_ceiling, segs = [], [], [], [], []
    for rep in range(reps + 2):
        src = list(range(num_pages)) if not scatter else rng.permutation(NUM_PAGES)[:num_pages].tolist()
        dst = list(range(4, 4 + num_pages)) if not scatter else \
            rng.permutation(NUM_PAGES)[:num_pages].tolist()
        latency_s, seg = transfer_once(pipes, first_room + rep, src, dst)
        memcpy_s, page_s, ceiling_s = baseline.seconds(src, dst)   # interleaved: both see the same load
        if rep >= 2:
            lat.append(latency_s)
            mem.append(memcpy_s)
            mem_page.append(page_s)
            mem_ceiling.append(ceiling_s)
            segs.append(seg)
    key = {128: "kv128", 1024: "kv1k", 4096: "kv4k"}[tokens]
    out = summarize(key, num_pages * smollm2_layout(NUM_PAGES).page_bytes, lat, mem, mem_page,
                    mem_ceiling, segs)
    print(f"{tokens:5d} tokens {out[key + '_bytes'] / 2**20:6.1f} MiB: {out[key + '_gbps']:6.2f} GB/s "
          f"(median {out[key + '_latency_ms']:.2f} ms, p90 {out[key + '_p90_latency_ms']:.2f} ms, overhead "
          f"{out[key + '_overhead_ms']:.2f} ms) | memcpy {out[key + '_memcpy_gbps']:6.2f} GB/s | "
          f"ratio {out[key + '_ratio']:.2f} | memcpy per page {out[key + '_memcpy_page_gbps']:6.2f} GB/s, "
          f"ratio {out[key + '_ratio_page']:.2f} | cached-store ceiling ({CEILING_THREADS} threads) "
          f"{out[key + '_memcpy_ceiling_gbps']:6.2f} GB/s = {out[key + '_ceiling_ratio']:.2f}x memcpy, ratio "
          f"{out[key + '_ratio_ceiling']:.2f}", flush=True)
    print("      median ms: " + ", ".join(f"{name} {out[f'{key}_{name}_ms']:.3f}" for name, _, _ in SEGMENTS),
          flush=True)
    return out


def run(backend: str, reps: int, scatter: bool, sizes: tuple[int, ...] = SIZES_TOKENS, cold: bool = False,
        inline: bool = True, huge_pages: bool = True) -> dict:  # type: ignore[type-arg]
    """Every size with ``inline`` progress; then, when ``inline``, 128 tokens again with all transport work on
    the manager thread (``kv128_thread_*`` keys): the thread hop it saves, measured in the same run."""
    result: dict = {"backend": backend, "dtype": KV_DTYPE, "scatter": scatter, "cold": cold,
                    "inline_progress": inline, "huge_pages": huge_pages,
                    "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    passes = [(inline, sizes, "")] + ([(False, (128,), "thread_")] if inline and 128 in sizes else [])
    for pass_inline, pass_sizes, prefix in passes:
        print(f"inline_progress={pass_inline}:", flush=True)
        pipes, procs = start_workers(backend, cold, pass_inline, huge_pages)
        for i, tokens in enumerate(pass_sizes):
            out = measure_size(pipes, tokens, reps, scatter, cold, 1 + 1000 * i, huge_pages)
            result.update({k.replace("kv128_", f"kv128_{prefix}"): v for k, v in out.items()})
        for pipe in pipes.values():
            pipe.send(("stop", 0, None))
        for proc in procs:
            proc.join(30)
    result["memcpy_gbps"] = result.get("kv4k_memcpy_gbps")
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result.update(compare_descriptor_modes() if backend == "nixl" else mooncake_raw(scatter))
    if backend == "nixl":
        result.update(compare_layouts(scatter, max(2, min(reps, 8))))
    return result


def compare_layouts(scatter: bool, reps: int = 8) -> dict:  # type: ignore[type-arg]
    """The page-major pool against the layer-major one it replaced, on the same bytes in the same run: the 4k
    prompt's 256 pages WRITTEN between two NIXL agents of this process (UCX ``cma``, no notification) as one
    descriptor per page (layout v2) and as one per (layer, K/V, page) block, 60 per page (layout v1), pages
    random on both sides with ``scatter``; and v2 again between two agents whose UCX backend has
    ``COPY_THREADS`` copy threads (``v2t``: NIXL splits the 256 descriptors between them, as NixlTransport
    does where the process may use two cores); interleaved, medians, and memcpy of the same bytes."""
    from kv_transfer.nixl_transport import COPY_THREADS, SPLIT_MIN_DESCS, apply_ucx_defaults

    apply_ucx_defaults()   # as NixlTransport does: the same UCX as the transfers above
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

    layout = smollm2_layout(NUM_PAGES)
    # layout v1's (layer, K/V, page) block held every head of the page's tokens
    blocks_per_page = layout.num_layers * 2
    block = layout.page_bytes // blocks_per_page
    pools = [np.ones(layout.pool_bytes, dtype=np.uint8) for _ in range(2)]
    threaded = {"num_threads": str(COPY_THREADS), "split_batch_size": str(SPLIT_MIN_DESCS)}
    pairs = {}
    for tag, params in (("layout", {}), ("layout-threads", threaded)):
        agents = [nixl_agent(f"{tag}-{i}", nixl_agent_config(enable_prog_thread=False, backends=[]))
                  for i in range(2)]
        for agent, pool in zip(agents, pools):
            agent.create_backend("UCX", params)
            agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
        agents[0].add_remote_agent(agents[1].get_agent_metadata())
        pairs[tag] = agents
    rng, num_pages = np.random.default_rng(11), 4096 // PAGE_SIZE
    times: dict[str, list[float]] = {"v2": [], "v1": [], "v2t": [], "memcpy": []}
    for _ in range(reps + 1):
        src = rng.permutation(NUM_PAGES)[:num_pages] if scatter else np.arange(num_pages)
        dst = rng.permutation(NUM_PAGES)[:num_pages] if scatter else np.arange(num_pages) + 4
        for name, unit, per_page in (("v2", layout.page_bytes, 1), ("v1", block, blocks_per_page),
                                     ("v2t", layout.page_bytes, 1)):
            agents = pairs["layout-threads" if name == "v2t" else "layout"]
            # v1 addressed block (l, kv, p) at ((l * 2 + kv) * num_pages + p) * block: per page, 60 blocks
            # one plane apart; v2 addresses page p at p * page_bytes
            planes = np.arange(per_page, dtype=np.int64)[:, None] * (NUM_PAGES * block if per_page > 1 else 0)
            offsets = [(planes + np.asarray(pages, dtype=np.int64)[None, :] * unit).reshape(-1)
                       for pages in (src, dst)]
            descs = [np.stack([pool.ctypes.data + off, np.full(len(off), unit),
                               np.zeros(len(off), np.int64)], 1)
                     for pool, off in zip(pools, offsets)]
            local, remote = (agents[0].get_xfer_descs(d, "DRAM") for d in descs)
            t0 = time.perf_counter()
            handle = agents[0].initialize_xfer("WRITE", local, remote, agents[1].name, b"")
            agents[0].transfer(handle)
            while agents[0].check_xfer_state(handle) == "PROC":
                agents[1].get_new_notifs()   # the target's progress (connection set-up needs it)
                # a sleeping poll, as the managers': the copy threads keep the cores
                time.sleep(0.00005)
            times[name].append(time.perf_counter() - t0)
            agents[0].release_xfer_handle(handle)
        t0 = time.perf_counter()
        np.copyto(pools[1][:num_pages * layout.page_bytes], pools[0][-num_pages * layout.page_bytes:])
        times["memcpy"].append(time.perf_counter() - t0)
    nbytes = num_pages * layout.page_bytes
    out = {f"layout_{k}_gbps": round(nbytes / statistics.median(v[1:]) / 1e9, 3) for k, v in times.items()}
    out["layout_v2_ratio"] = round(
        statistics.median(times["memcpy"][1:]) / statistics.median(times["v2"][1:]), 3)
    for name in ("v1", "v2t"):
        out[f"layout_{name}_ratio"] = round(statistics.median(times["memcpy"][1:])
                                            / statistics.median(times[name][1:]), 3)
    print("layouts, 4k tokens{}: page-major (v2) {layout_v2_gbps} GB/s ({layout_v2_ratio}x memcpy), "
          "layer-major (v1) {layout_v1_gbps} GB/s ({layout_v1_ratio}x), v2 on copy threads {layout_v2t_gbps} "
          "GB/s ({layout_v2t_ratio}x), memcpy {layout_memcpy_gbps} GB/s".format(
              ", scattered" if scatter else "", **out), flush=True)
    return out


def mooncake_raw(scatter: bool, reps: int = 10) -> dict:  # type: ignore[type-arg]
    """Where Mooncake's time goes: the 4k-token prompt's bytes written with ``batch_transfer_sync_write``
    alone (two engines in this process, TCP on loopback, no manager, no notification), as one descriptor and
    as one per page (random pages with ``scatter``), against memcpy of the same bytes."""
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

    layout = smollm2_layout(NUM_PAGES)
    pools = [np.ones(layout.pool_bytes, dtype=np.uint8) for _ in range(2)]
    engines = [TransferEngine() for _ in range(2)]
    for engine, pool in zip(engines, pools):
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert engine.register_memory(pool.ctypes.data, pool.nbytes) == 0
    peer = f"127.0.0.1:{engines[1].get_rpc_port()}"
    num_pages, page = 4096 // PAGE_SIZE, layout.page_bytes
    rng = np.random.default_rng(7)
    out: dict = {}  # type: ignore[type-arg]
    for name, descs in (("one", 1), ("pages", num_pages)):
        times = []
        for _ in range(reps + 1):
            src = rng.permutation(NUM_PAGES)[:num_pages] if scatter else np.arange(num_pages)
            dst = rng.permutation(NUM_PAGES)[:num_pages] if scatter else np.arange(num_pages)
            if descs == 1:
                srcs, dsts, lens = [pools[0].ctypes.data], [pools[1].ctypes.data], [num_pages * page]
            else:
                srcs = [pools[0].ctypes.data + int(p) * page for p in src]
                dsts = [pools[1].ctypes.data + int(p) * page for p in dst]
                lens = [page] * num_pages
            t0 = time.perf_counter()
            assert engines[0].batch_transfer_sync_write(peer, srcs, dsts, lens) == 0
            times.append(time.perf_counter() - t0)
        out[f"mooncake_raw_{name}_gbps"] = round(num_pages * page / statistics.median(times[1:]) / 1e9, 3)
    flat = [np.empty(num_pages * page, dtype=np.uint8) for _ in range(2)]
    flat[0].fill(1), flat[1].fill(2)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(flat[1], flat[0])
    out["mooncake_raw_memcpy_gbps"] = round(num_pages * page * reps / (time.perf_counter() - t0) / 1e9, 3)
    for engine, pool in zip(engines, pools):
        engine.unregister_memory(pool.ctypes.data)
    print("mooncake alone, 4k tokens: one descriptor {mooncake_raw_one_gbps} GB/s, one per page "
          "{mooncake_raw_pages_gbps} GB/s, memcpy {mooncake_raw_memcpy_gbps} GB/s".format(**out), flush=True)
    return out


def compare_descriptor_modes(reps: int = 300) -> dict:  # type: ignore[type-arg]
    """Cost of creating one transfer for an 8-page chunk (128 tokens), two agents in this process: merged
    descriptor lists built per chunk (get_xfer_descs + initialize_xfer) against lists prepared once per agent
    (make_prepped_xfer with block indices). Handles are created and released, not transferred."""
    from kv_transfer.nixl_transport import apply_ucx_defaults

    apply_ucx_defaults()
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

    from kv_transfer.blocks import BlockTable
    layout = smollm2_layout(64)
    pools = [np.ones(layout.pool_bytes, dtype=np.uint8) for _ in range(2)]
    aux = [np.zeros(32, dtype=np.uint8) for _ in range(2)]
    tables = [BlockTable(p.ctypes.data, layout, a.ctypes.data, 1) for p, a in zip(pools, aux)]
    agents = [nixl_agent(f"desc-{i}", nixl_agent_config(enable_prog_thread=False)) for i in range(2)]
    for agent, pool in zip(agents, pools):
        agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    agents[0].add_remote_agent(agents[1].get_agent_metadata())
    n = tables[0].num_kv_descs
    local = agents[0].prep_xfer_dlist("NIXL_INIT_AGENT", tables[0].descriptors(0, n), "DRAM")
    remote = agents[0].prep_xfer_dlist("desc-1", tables[1].descriptors(0, n), "DRAM")
    src, dst = tables[0].kv_indices(range(8)), tables[1].kv_indices(range(10, 18))
    t0 = time.perf_counter()
    for _ in range(reps):
        agents[0].release_xfer_handle(agents[0].make_prepped_xfer("WRITE", local, src, remote, dst, b"x"))
    prepped_us = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for _ in range(reps):
        src_d = agents[0].get_xfer_descs(merged(tables[0], range(8)), "DRAM")
        dst_d = agents[0].get_xfer_descs(merged(tables[1], range(10, 18)), "DRAM")
        agents[0].release_xfer_handle(agents[0].initialize_xfer("WRITE", src_d, dst_d, "desc-1", b"x"))
    merged_us = (time.perf_counter() - t0) / reps * 1e6
    print(f"descriptors, 8-page chunk: prepared lists {prepped_us:.0f} us/request, merged per chunk "
          f"{merged_us:.0f} us/request", flush=True)
    return {"desc_prepped_us": round(prepped_us, 1), "desc_merged_us": round(merged_us, 1)}


def merged(table: object, pages: range) -> np.ndarray:
    """One descriptor for a contiguous run of pages (page-major pool): [1, 3] (addr, len, dev)."""
    first = table.spans(table.kv_indices([pages[0]]))  # type: ignore[attr-defined]
    return np.stack([first[:, 0], first[:, 1] * len(pages), np.zeros(len(first), dtype=np.int64)], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="nixl",
                        help="comma-separated KV backends, each of nixl, mooncake (default nixl)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--scatter", action="store_true", help="random, non-contiguous pages on both sides")
    parser.add_argument("--sizes", default="128,1024,4096", help="prompt lengths in tokens (128, 1024, 4096)")
    parser.add_argument("--cold", action="store_true",
                        help="idle prefill: 2 ms of sleep before send, source pages not rewritten")
    parser.add_argument("--no-inline", action="store_true",
                        help="KVArgs.inline_progress=False: every WRITE and notification on the manager "
                             "thread")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="KV pools (both processes and the memcpy baseline) on 4 KiB pages, as before "
                             "engine.kv_pool asked for transparent huge pages")
    parser.add_argument("--dtype", default="float32", choices=sorted(_NP_DTYPES),
                        help="the KV cache's dtype (an engine's dtype: bfloat16 halves the bytes per page)")
    args = parser.parse_args()
    global KV_DTYPE
    KV_DTYPE = args.dtype
    sizes = tuple(int(t) for t in args.sizes.split(","))
    if not set(sizes) <= set(SIZES_TOKENS):
        parser.error(f"--sizes: each of {SIZES_TOKENS}")
    backends = args.backend.split(",")
    if not set(backends) <= {"nixl", "mooncake"}:
        parser.error("--backend: each of nixl, mooncake")
    results = {}
    for backend in backends:
        print(f"== backend {backend}, KV {KV_DTYPE}", flush=True)
        results[backend] = run(backend, args.reps, args.scatter, sizes, args.cold, not args.no_inline,
                               not args.no_huge_pages)
    print(json.dumps(results[backends[0]] if len(backends) == 1 else {"backends": results}))


if __name__ == "__main__":
    main()
