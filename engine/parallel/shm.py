"""``ShmCommunicator``: the collectives of CPU ranks on one host, through one shared memory region.

Why not gloo: on this project's 2-core hosts a gloo all-reduce of one decode row (576 floats) over loopback
TCP took 1.2-2.5 ms (its calling thread hands the work to gloo's own threads and waits on a condition
variable); a SmolLM2 step makes 60 of them. Here a rank copies its part into its slot of the region, raises
its flag and waits for the others' flags (``shm_sync.c``: a short spin, then a futex sleep), then reads their
slots: a decode row's all-reduce costs a few microseconds of copies and adds once the ranks are in step.

The region (``create_region``) is a memfd: it has no name, so nothing is left behind however the processes end
(rank 0 passes the descriptor to the rank processes it starts). Layout (bytes):

```
0                 abort word (int32; its own 64-byte line)
64  .. 320        abort reason (UTF-8, NUL-terminated)
512 + 64 * r      arrive flag of rank r   (shm_sync.c's tp_flag: seq int32, waiters int32, padding)
512 + 64 * (N+r)  done flag of rank r
data_offset + (2 * r + p) * buffer_bytes    rank r's slot for operations of parity p (4 KiB-aligned)
```

Every operation (one piece of a collective) has a sequence number, the same on every rank. For operation
``s`` a rank waits until every other rank's done flag reached ``s - 2`` (nobody still reads its slot of parity
``s % 2``), writes its slot, raises its arrive flag to ``s``, waits for the arrive flags it needs, reads,
and raises its done flag to ``s``. A collective larger than a slot runs as several operations.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from pathlib import Path

import torch

from engine.parallel.communicator import CollectiveError, Communicator, OpTimer

_FLAG_BYTES = 64
_REASON_OFFSET, _REASON_BYTES = 64, 256
_FLAGS_OFFSET = 512
_ALIGN = 4096
_SOURCE = Path(__file__).with_name("shm_sync.c")
_FLAGS = ("-O3", "-shared", "-fPIC")
#: how long a wait spins before it sleeps on the futex: covers a step's skew between ranks and rank 0's work
#: between steps (sampling, scheduling), so a step in flight never pays a wake-up
DEFAULT_SPIN_S = 0.005


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _data_offset(world_size: int) -> int:
    return _align(_FLAGS_OFFSET + 2 * world_size * _FLAG_BYTES)


def region_bytes(world_size: int, buffer_bytes: int) -> int:
    """Size of the region for ``world_size`` ranks with slots of ``buffer_bytes`` (a multiple of 4 KiB)."""
    return _data_offset(world_size) + 2 * world_size * buffer_bytes


def create_region(world_size: int, buffer_bytes: int) -> int:
    """A zeroed memfd of ``region_bytes`` (close-on-exec; pass it to a child with ``pass_fds``); returns its
    descriptor, owned by the caller. Raises OSError (no memfd, no memory)."""
    fd = os.memfd_create("triton-pd-tensor-parallel", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, region_bytes(world_size, buffer_bytes))
    except OSError:
        os.close(fd)
        raise
    return fd


@functools.cache
def shm_sync_library() -> ctypes.CDLL:
    """``shm_sync.c`` built and loaded (``engine.model.kernels.build.build_library``).

    Raises:
        OSError, subprocess.SubprocessError: no compiler, or the build failed.
    """
    from engine.model.kernels.build import build_library

    lib = build_library(_SOURCE, _FLAGS)
    lib.tp_post.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.tp_post.restype = None
    lib.tp_abort.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.tp_abort.restype = None
    lib.tp_wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64]
    lib.tp_wait.restype = ctypes.c_int
    lib.tp_all_reduce.argtypes = [ctypes.POINTER(_Context), ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_int64, ctypes.POINTER(ctypes.c_int32),
                                  ctypes.POINTER(ctypes.c_int64)]
    lib.tp_all_reduce.restype = ctypes.c_int
    return lib


class _Context(ctypes.Structure):
    """``shm_sync.c``'s ``tp_ctx``: the region as this rank sees it."""

    _fields_ = [("arrive", ctypes.c_void_p), ("done", ctypes.c_void_p), ("abort_word", ctypes.c_void_p),
                ("data", ctypes.c_void_p), ("buffer_bytes", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("world", ctypes.c_int64), ("spin_ns", ctypes.c_int64), ("timeout_ns", ctypes.c_int64)]


#: dtypes ``tp_all_reduce`` sums in C (its ``dtype`` argument); others take the torch path
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _i32(seq: int) -> int:
    """A sequence number as the signed 32-bit value the flags hold (they wrap)."""
    seq &= 0xFFFFFFFF
    return seq - (1 << 32) if seq >= 1 << 31 else seq


class ShmCommunicator(Communicator):
    """Collectives over the region ``fd`` (``create_region``) shared by the ``world_size`` ranks of one host.

    Args:
        fd: the region's descriptor (this rank's copy; the caller may close it once this is built).
        rank, world_size, logit_widths, timeout_s: as ``Communicator``.
        buffer_bytes: bytes of each slot (a multiple of 4 KiB), as the region was made with.
        spin_s: how long a wait spins before it sleeps (``DEFAULT_SPIN_S``).

    Raises:
        OSError, subprocess.SubprocessError: ``shm_sync.c`` cannot be built here.
        ValueError: more than 64 ranks, or ``buffer_bytes`` not a multiple of 4 KiB.
    """

    def __init__(self, fd: int, rank: int, world_size: int, buffer_bytes: int, logit_widths: tuple[int, ...],
                 timeout_s: float, spin_s: float = DEFAULT_SPIN_S) -> None:
        super().__init__(rank, world_size, logit_widths, timeout_s)
        if world_size > 64 or buffer_bytes % _ALIGN:
            raise ValueError(f"need <= 64 ranks and 4 KiB-multiple slots, got {world_size}, {buffer_bytes}")
        self._lib = shm_sync_library()
        self._buffer_bytes = buffer_bytes
        self._map = mmap.mmap(fd, region_bytes(world_size, buffer_bytes), flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._region = torch.frombuffer(self._map, dtype=torch.uint8)   # [region_bytes] uint8
        base = self._region.data_ptr()
        self._abort_ptr = base
        self._arrive_ptr = base + _FLAGS_OFFSET
        self._done_ptr = base + _FLAGS_OFFSET + world_size * _FLAG_BYTES
        self._data_offset = _data_offset(world_size)
        self._others = sum(1 << r for r in range(world_size) if r != rank)
        self._spin_ns = int(spin_s * 1e9)
        self._seq = 0
        self._ctx = _Context(self._arrive_ptr, self._done_ptr, self._abort_ptr, base + self._data_offset,
                             buffer_bytes, rank, world_size, self._spin_ns, int(timeout_s * 1e9))
        self._last_seq = ctypes.c_int32(0)
        self._wait_ns = ctypes.c_int64(0)
        # [rank][parity]: each slot as uint8, and (parity, dtype, count): every rank's slot head side by side
        self._slots = [[self._region[self._slot_offset(r, p):self._slot_offset(r, p) + buffer_bytes]
                        for p in range(2)] for r in range(world_size)]
        self._heads: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}

    # ---- collectives ---------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        code = _C_DTYPES.get(x.dtype)
        if code is None or not x.is_contiguous():
            return self._all_reduce_torch(x)
        with self._timed("all_reduce", x.numel() * x.element_size()) as timer:
            rc = self._lib.tp_all_reduce(ctypes.byref(self._ctx), _i32(self._seq), x.data_ptr(), x.numel(),
                                         code, ctypes.byref(self._last_seq), ctypes.byref(self._wait_ns))
            self._seq += _i32(self._last_seq.value - _i32(self._seq)) if x.numel() else 0
            timer.waited(self._wait_ns.value / 1e9)
        if rc:
            raise self._failure("all_reduce", rc, self._arrive_ptr, self._others, self._seq)
        return x

    def _all_reduce_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``all_reduce`` step by step in torch: other dtypes (float16) and non-contiguous tensors."""
        if not x.is_contiguous():
            return x.copy_(self._all_reduce_torch(x.contiguous()))
        flat = x.view(-1)
        per = self._buffer_bytes // x.element_size()
        with self._timed("all_reduce", x.numel() * x.element_size()) as timer:
            for a in range(0, flat.numel(), per):
                piece = flat[a:a + per]
                seq = self._begin("all_reduce", timer)
                self._slot(self.rank, seq, x.dtype, piece.numel()).copy_(piece)
                self._post(self._arrive_ptr, seq)
                self._wait("all_reduce", self._arrive_ptr, self._others, seq, timer)
                slots = [self._slot(r, seq, x.dtype, piece.numel()) for r in range(self.world_size)]
                if x.dtype == torch.float32:
                    torch.add(slots[0], slots[1], out=piece)
                    for s in slots[2:]:
                        piece += s
                else:   # sum narrow dtypes in float32, as a single rank's product accumulates
                    acc = slots[0].float()
                    for s in slots[1:]:
                        acc += s
                    piece.copy_(acc)
                self._post(self._done_ptr, seq)
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        rows, widths = logits.shape[0], self.logit_widths
        per = max(1, self._buffer_bytes // (4 * max(widths)))   # whole rows per operation
        starts = [sum(widths[:r]) for r in range(self.world_size)]
        out = torch.empty(rows, sum(widths), dtype=torch.float32) if self.rank == 0 else logits
        with self._timed("gather_logits", logits.numel() * 4) as timer:
            for a in range(0, rows, per):
                n = min(per, rows - a)
                seq = self._begin("gather_logits", timer)
                if self.rank != 0:
                    self._slot(self.rank, seq, torch.float32, n * widths[self.rank]).copy_(
                        logits[a:a + n].reshape(-1))
                self._post(self._arrive_ptr, seq)
                if self.rank == 0:
                    self._wait("gather_logits", self._arrive_ptr, self._others, seq, timer)
                    for r in range(1, self.world_size):
                        out[a:a + n, starts[r]:starts[r] + widths[r]].copy_(
                            self._slot(r, seq, torch.float32, n * widths[r]).view(n, widths[r]))
                self._post(self._done_ptr, seq)
            if self.rank == 0:
                out[:, :widths[0]].copy_(logits)
        return out

    def broadcast_step(self, payload: torch.Tensor | None, wait_forever: bool = False) -> torch.Tensor:
        per = self._buffer_bytes // 8 - 1    # int64s per operation after the length word
        if self.rank == 0:
            assert payload is not None
            with self._timed("broadcast_step", payload.numel() * 8) as timer:
                for a in range(0, max(1, payload.numel()), per):
                    piece = payload[a:a + per]
                    seq = self._begin("broadcast_step", timer)
                    slot = self._slot(0, seq, torch.int64, piece.numel() + 1)
                    slot[0] = payload.numel()
                    slot[1:].copy_(piece)
                    self._post(self._arrive_ptr, seq)
                    self._post(self._done_ptr, seq)
            return payload
        with self._timed("broadcast_step", 0) as timer:
            out: torch.Tensor | None = None
            a = 0
            while out is None or a < out.numel():
                seq = self._begin("broadcast_step", timer)
                self._wait("broadcast_step", self._arrive_ptr, 1, seq, timer,
                           forever=wait_forever and out is None)
                if out is None:
                    out = torch.empty(int(self._slot(0, seq, torch.int64, 1)[0]), dtype=torch.int64)
                n = min(per, out.numel() - a)
                out[a:a + n].copy_(self._slot(0, seq, torch.int64, n + 1)[1:])
                self._post(self._done_ptr, seq)
                a += n
                if out.numel() == 0:
                    break
        return out

    # ---- operations whose slots the caller fills and reads (engine.model.shm_dispatch) ---------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of each rank's slot (``buffer_bytes``): the most one operation can carry from one rank."""
        return self._buffer_bytes

    def timer(self, op: str, nbytes: int) -> OpTimer:
        """An ``OpTimer`` adding to this rank's ``stats`` under ``op`` (``with comm.timer(op, n) as t``)."""
        return self._timed(op, nbytes)

    def open_operation(self, op: str, timer: OpTimer) -> int:
        """Start the next operation: wait until no rank still reads this rank's slot of its parity, then
        return its sequence number (for ``slot``, ``publish``, ``wait_published``, ``close_operation``).
        Every rank opens the same operations in the same order (the module contract).

        Raises:
            CollectiveError: the group was aborted, or a rank did not finish the operation two before within
                ``timeout_s``.
        """
        return self._begin(op, timer)

    def slot(self, rank: int, seq: int) -> torch.Tensor:
        """Rank ``rank``'s slot for operation ``seq``: ``[slot_bytes]`` uint8, a view of the shared region
        (4 KiB-aligned). This rank writes its own between ``open_operation`` and ``publish``; it reads another
        rank's between ``wait_published`` and ``close_operation``."""
        return self._slots[rank][seq % 2]

    def slot_heads(self, seq: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The first ``count`` values of every rank's slot for operation ``seq``: ``[world_size, count]`` of
        ``dtype``, one strided view of the region (row ``r``: rank ``r``'s slot), read under the same rules
        as ``slot``."""
        key = (seq % 2, dtype, count)
        heads = self._heads.get(key)
        if heads is None:
            itemsize = dtype.itemsize
            heads = self._region.view(dtype).as_strided(
                (self.world_size, count), (2 * self._buffer_bytes // itemsize, 1),
                self._slot_offset(0, seq % 2) // itemsize)
            self._heads[key] = heads
        return heads

    def publish(self, seq: int) -> None:
        """This rank's slot of operation ``seq`` is written: the other ranks may read it."""
        self._post(self._arrive_ptr, seq)

    def wait_published(self, op: str, seq: int, timer: OpTimer) -> None:
        """Wait until every other rank published operation ``seq``.

        Raises:
            CollectiveError: the group was aborted, or a rank did not publish within ``timeout_s``.
        """
        self._wait(op, self._arrive_ptr, self._others, seq, timer)

    def close_operation(self, seq: int) -> None:
        """This rank read what it needed of the other ranks' slots of operation ``seq``."""
        self._post(self._done_ptr, seq)

    # ---- group state ---------------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        if self._map.closed:
            return
        text = reason.encode()[:_REASON_BYTES - 1] + b"\0"
        if not self.aborted:   # the first reason stays
            self._region[_REASON_OFFSET:_REASON_OFFSET + len(text)].copy_(torch.frombuffer(bytearray(text),
                                                                                           dtype=torch.uint8))
        self._lib.tp_abort(self._abort_ptr, self._arrive_ptr, 2 * self.world_size)

    @property
    def aborted(self) -> bool:
        """True once any rank aborted the group."""
        return bool(self._region[:4].view(torch.int32)[0])

    def abort_reason(self) -> str:
        """The reason the first ``abort`` gave ('' when not aborted)."""
        raw = bytes(self._region[_REASON_OFFSET:_REASON_OFFSET + _REASON_BYTES].tolist())
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        if self._map.closed:
            return
        del self._region, self._slots, self._heads
        self._map.close()

    # ---- one operation -------------------------------------------------------------------------------------
    def _begin(self, op: str, timer: OpTimer) -> int:
        self._seq += 1
        if self._seq > 2:   # every other rank is done reading its slots of this parity
            self._wait(op, self._done_ptr, self._others, self._seq - 2, timer)
        return self._seq

    def _slot_offset(self, rank: int, parity: int) -> int:
        return self._data_offset + (2 * rank + parity) * self._buffer_bytes

    def _slot(self, rank: int, seq: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._slots[rank][seq % 2][:numel * dtype.itemsize].view(dtype)

    def _post(self, flags_ptr: int, seq: int) -> None:
        self._lib.tp_post(flags_ptr + self.rank * _FLAG_BYTES, _i32(seq))

    def _wait(self, op: str, flags_ptr: int, mask: int, seq: int, timer: OpTimer,
              forever: bool = False) -> None:
        start = time.perf_counter()
        timeout_ns = -1 if forever else int(self.timeout_s * 1e9)
        rc = self._lib.tp_wait(flags_ptr, mask, _i32(seq), self._abort_ptr, self._spin_ns, timeout_ns)
        timer.waited(time.perf_counter() - start)
        if rc:
            raise self._failure(op, rc, flags_ptr, mask, seq)

    def _failure(self, op: str, rc: int, flags_ptr: int, mask: int, seq: int) -> CollectiveError:
        """The error of a wait that returned ``rc`` (1: aborted, 2: timed out)."""
        if rc == 1:
            return CollectiveError(op, f"the group was aborted: {self.abort_reason() or 'no reason given'}")
        flags = self._region[flags_ptr - self._abort_ptr:].view(torch.int32)
        late = [r for r in range(self.world_size)
                if mask >> r & 1 and _i32(int(flags[r * _FLAG_BYTES // 4]) - _i32(seq)) < 0]
        waited = late or [r for r in range(self.world_size) if mask >> r & 1]
        return CollectiveError(op, f"rank(s) {waited} did not reach operation {seq} within "
                                   f"{self.timeout_s:g} s (tp_timeout_s)")
