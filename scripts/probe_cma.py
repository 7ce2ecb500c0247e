"""Probe: the ceiling of UCX's ``cma`` transport on this host, without UCX.

``cma`` moves bytes with ``process_vm_writev`` (the kernel pins the target's pages and copies into them). This
writes the 4k-token prompt's bytes (256 pages of 737,280 bytes = 180 MiB) from this process into a child
process's buffer with ``process_vm_writev`` directly (ctypes), as one iovec, as one iovec per page, and in
``--seg-kib`` segments (UCX's scopy transport splits a PUT into segments of ``UCX_CMA_SEG_SIZE``), against a
memcpy (``ctypes.memmove``) of the same bytes between two buffers of this process, interleaved, medians.
Each buffer is allocated either as numpy does (``malloc``: 4 KiB pages) or 2 MiB-aligned with
``madvise(MADV_HUGEPAGE)`` (transparent huge pages; THP is in ``madvise`` mode here), and every byte is
touched first; the AnonHugePages of both processes are printed to confirm which pages they got.

Usage: python scripts/probe_cma.py [--mib 180] [--reps 15] [--seg-kib 512]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import threading
import time

import numpy as np

HUGE_BYTES = 2 << 20
PAGE_BYTES = 737_280   # one KV page of the SmolLM2 layout (scripts/bench_kv_transfer.py)


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                                    ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]


def alloc(nbytes: int, huge: bool) -> tuple[object, np.ndarray]:
    """(owner, uint8 array of ``nbytes``), 2 MiB-aligned, every byte touched; ``huge``: MADV_HUGEPAGE, else
    MADV_NOHUGEPAGE (4 KiB pages, as torch's CPU allocator gives the engine's pool; numpy's own allocator
    asks for huge pages above 4 MiB, so ``np.ones`` would not do)."""
    region = mmap.mmap(-1, nbytes + HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, 0, len(region))
    arr = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=offset)
    arr.fill(1)
    return region, arr


def anon_huge_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def child(nbytes: int, conn) -> None:  # type: ignore[no-untyped-def]
    """Holds one destination buffer per allocation mode; sends their addresses, waits for 'stop'."""
    bufs = {huge: alloc(nbytes, huge) for huge in (False, True)}
    conn.send({huge: int(arr.ctypes.data) for huge, (_, arr) in bufs.items()})
    conn.recv()


def writev(pid: int, src: int, dst: int, nbytes: int, seg_bytes: int) -> None:
    """``nbytes`` from local ``src`` to remote ``dst``, one syscall per ``seg_bytes`` (one iovec pair
    each)."""
    done = 0
    while done < nbytes:
        n = min(seg_bytes, nbytes - done)
        local, remote = IoVec(src + done, n), IoVec(dst + done, n)
        got = _libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != n:
            raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got} of {n}")
        done += n


def writev_pages(pid: int, src: int, dst: int, nbytes: int) -> None:
    """One syscall, one iovec per KV page on both sides (what a scattered WRITE would hand the kernel)."""
    n = nbytes // PAGE_BYTES
    local = (IoVec * n)(*[IoVec(src + i * PAGE_BYTES, PAGE_BYTES) for i in range(n)])
    remote = (IoVec * n)(*[IoVec(dst + i * PAGE_BYTES, PAGE_BYTES) for i in range(n)])
    got = _libc.process_vm_writev(pid, local, n, remote, n, 0)
    if got != n * PAGE_BYTES:
        raise OSError(ctypes.get_errno(), f"process_vm_writev wrote {got}")


def writev_threads(pid: int, src: int, dst: int, nbytes: int, threads: int) -> None:
    """``nbytes`` split into ``threads`` equal parts, each written by its own thread (ctypes drops the
    GIL)."""
    part = nbytes // threads
    workers = [threading.Thread(target=writev, args=(pid, src + i * part, dst + i * part,
                                                     part if i < threads - 1 else nbytes - i * part, nbytes))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def memcpy_pages(src: int, dst: int, nbytes: int) -> None:
    """One memcpy per KV page: below glibc's non-temporal threshold, so cached stores, as the kernel's
    copy."""
    for off in range(0, nbytes, PAGE_BYTES):
        ctypes.memmove(dst + off, src + off, min(PAGE_BYTES, nbytes - off))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=180)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seg-kib", type=int, default=512)
    args = parser.parse_args()
    nbytes = (args.mib << 20) // PAGE_BYTES * PAGE_BYTES
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(nbytes, child_end), daemon=True)
    proc.start()
    remote = parent.recv()
    local = {huge: alloc(nbytes, huge) for huge in (False, True)}
    local_dst = {huge: alloc(nbytes, huge) for huge in (False, True)}
    print(f"AnonHugePages: this process {anon_huge_kib()} KiB, child {anon_huge_kib(proc.pid)} KiB "
          f"(buffers of {nbytes / 2**20:.0f} MiB; one 2 MiB-aligned MADV_HUGEPAGE buffer per side and mode)")
    seg = args.seg_kib << 10
    cases = {}
    for huge in (False, True):
        src, dst, mem_dst = (int(local[huge][1].ctypes.data), remote[huge],
                             int(local_dst[huge][1].ctypes.data))
        tag = "thp" if huge else "4k"
        cases[f"memcpy_{tag}"] = lambda s=src, d=mem_dst: ctypes.memmove(d, s, nbytes)
        cases[f"memcpy_pages_{tag}"] = lambda s=src, d=mem_dst: memcpy_pages(s, d, nbytes)
        cases[f"cma_one_{tag}"] = lambda s=src, d=dst: writev(proc.pid, s, d, nbytes, nbytes)
        cases[f"cma_seg{args.seg_kib}k_{tag}"] = lambda s=src, d=dst: writev(proc.pid, s, d, nbytes, seg)
        cases[f"cma_pages_{tag}"] = lambda s=src, d=dst: writev_pages(proc.pid, s, d, nbytes)
        cases[f"cma_2threads_{tag}"] = lambda s=src, d=dst: writev_threads(proc.pid, s, d, nbytes, 2)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps + 1):   # interleaved; the first round is a warm-up
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    parent.send("stop")
    proc.join(10)
    out = {"loadavg_1m": round(os.getloadavg()[0], 2), "mib": round(nbytes / 2**20, 1)}
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        out[f"{name}_ms"], out[f"{name}_gbps"] = round(med * 1e3, 2), round(nbytes / med / 1e9, 2)
        print(f"{name:22s} {med * 1e3:7.2f} ms  {nbytes / med / 1e9:6.2f} GB/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
