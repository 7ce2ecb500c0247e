"""The paged KV pool: one contiguous region per engine, page-major and head-major inside a page, laid out as
in docs/architecture.md.

Memory order ``[num_pages, num_kv_heads, num_layers, num_planes, page_size, head_dim]``: one page of every
layer, K and V, is one contiguous region of ``page_bytes``, so a prompt's pages move as one descriptor each
however scattered they are in the pool (with layer-major order a page was ``2 * num_layers`` separate blocks);
inside a page, one KV head's K and V of every layer are one contiguous range of ``page_head_bytes``, so the
heads ``[a, b)`` of a page are one range too: what a tensor-parallel rank holds, moved whole between
instances whose ranks split the heads differently (head-major as vLLM's "HND" layout is for heterogeneous TP;
with the heads innermost, token-major, each token's heads were their own 256-512 B span: docs/parallelism.md).
The model sees the same memory as ``kv_cache[l, kv, p, s, h, d]`` (a strided view): element ``d`` of head
``h`` of the K (``kv=0``) or V (``kv=1``) vector of the token in slot ``s`` of page ``p`` in layer ``l``.
The block of one (page, head, layer, kv) holds its ``page_size`` tokens' vectors, contiguous; its byte offset
from the region base is ``(((p * num_kv_heads + h) * num_layers + l) * num_planes + kv) * block_bytes``, and
page ``p`` starts at ``p * page_bytes``.

MLA models (``KVShape.kind == "mla"``) keep one plane instead of two: the token's latent ``c_kv | k_pe``
(``num_kv_heads`` 1, ``head_dim`` = ``kv_lora_rank + qk_rope_head_dim``), no separate V; everywhere above, 2
becomes ``num_planes`` = 1 (``[num_pages, 1, num_layers, 1, page_size, latent_dim]``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.page_allocator import PageId

logger = logging.getLogger(__name__)

#: Transparent huge page size on x86-64 (and the alignment a region needs for the kernel to back it with
#: them).
HUGE_PAGE_BYTES = 2 << 20


#: KV layout kinds and the planes (K and V, or the MLA latent alone) each holds per (page, layer)
KV_PLANES = {"mha": 2, "mla": 1}


@dataclass(frozen=True)
class KVShape:
    """Model-side dimensions of the pool.

    Attributes:
        kind: ``"mha"`` (a K and a V plane per layer) or ``"mla"`` (one latent plane; ``ModelConfig.
            kv_layout_kind``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kind: str = "mha"

    def __post_init__(self) -> None:
        if self.kind not in KV_PLANES:
            raise ValueError(f"KV layout kind {self.kind!r} not one of {sorted(KV_PLANES)}")

    @property
    def num_planes(self) -> int:
        """Planes per (page, layer): 2 (K, V) or 1 (the MLA latent)."""
        return KV_PLANES[self.kind]

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one (page, head, layer, kv) block: ``page_size * head_dim * itemsize``."""
        return self.page_size * self.head_dim * _itemsize(dtype)

    def page_head_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one KV head in one page, every layer and plane (contiguous)."""
        return self.num_planes * self.num_layers * self.block_bytes(dtype)

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one page holds over all heads, layers and planes."""
        return self.num_kv_heads * self.page_head_bytes(dtype)

    def pages_for_bytes(self, nbytes: int, dtype: torch.dtype) -> int:
        """Whole pages that fit in ``nbytes``."""
        return nbytes // self.page_bytes(dtype)


class KVPool:
    """Owns the KV tensor; allocated and touched (faulted in) once, before or just after serving starts.

    Touching matters: the first write into never-touched memory is slow (page faults, ~10 ms per request seen
    when a transfer wrote into a fresh pool). A host mapping is zero already (anonymous memory), so it is not
    written: its pages are populated by the kernel (``MADV_POPULATE_WRITE``, Linux 5.14+) on a daemon thread,
    which leaves every byte as it is, so the engine may write the pool meanwhile; start-up does not wait for
    it (zeroing a 377 MiB pool took 0.9-1.5 s of a 7 s prefill server start on a quiet 2-core host, most of
    it the kernel's huge-page compaction, and several times that under load: docs/healing.md). Where the
    kernel refuses the advice, and for device memory, every byte is zeroed here instead.

    Host memory: with ``huge_pages`` the region is its own anonymous mapping, 2 MiB-aligned, advised
    ``MADV_HUGEPAGE`` (transparent huge pages; hosts in THP ``madvise`` mode give them only where asked), so
    the kernel's copy into it from another process (UCX ``cma``: ``process_vm_writev`` pins the target's
    pages) and the model's reads walk 512 times fewer page-table entries (that copy runs 1.1-1.6x faster).
    torch's own allocator never asks for huge pages. Without THP support the advice is a no-op.

    ``shared_fd`` (a memfd of exactly the pool's bytes, ``shared_pool_fd``): the pool is a shared mapping of
    it instead (no huge-page advice, no populate thread, zero already), so that two processes see the same KV:
    a tensor-parallel rank's pool, which rank 0 maps too for its KV transfer agent (docs/parallelism.md).
    ``fd_first_page`` / ``fd_num_pages``: the memfd holds ``fd_num_pages`` pages of this shape back to back
    (the pools of every DP-attention rank, one page-major region) and this pool is its pages
    ``[fd_first_page, fd_first_page + num_pages)``; the whole memfd is mapped, the pool is a view of its part.

    Attributes:
        storage: ``[num_pages, num_kv_heads, num_layers, num_planes, page_size, head_dim]``, ``dtype``,
            ``device``, contiguous (the region a KV transport registers); ``num_planes`` 2 (K, V) or 1 (MLA).
        kv_cache: ``[num_layers, num_planes, num_pages, page_size, num_kv_heads, head_dim]``, a strided view
            of ``storage`` (what the model indexes; never ``view`` it flat across pages).
        num_pages: pages in the pool.
        block_bytes: bytes of one (page, head, layer, kv) block.
        page_bytes: bytes of one page over all heads, layers, K and V.
        populating: the daemon thread faulting a host mapping in (done when it is no longer alive), or None
            when the memory was zeroed in the constructor.
    """

    def __init__(self, shape: KVShape, num_pages: int, dtype: torch.dtype,
                 device: torch.device | str, huge_pages: bool = True, shared_fd: int = -1,
                 fd_first_page: int = 0, fd_num_pages: int | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        fd_pages = num_pages if fd_num_pages is None else fd_num_pages
        if not 0 <= fd_first_page <= fd_pages - num_pages:
            raise ValueError(f"pages [{fd_first_page}, {fd_first_page + num_pages}) are not in a region of "
                             f"{fd_pages} pages")
        self.shape = shape
        self.num_pages = num_pages
        self.dtype = dtype
        self.block_bytes = shape.block_bytes(dtype)
        self.page_bytes = shape.page_bytes(dtype)
        dims = (num_pages, shape.num_kv_heads, shape.num_layers, shape.num_planes, shape.page_size,
                shape.head_dim)
        self._region: mmap.mmap | None = None   # owns the memory of ``storage`` when it is a host mapping
        # [num_pages, num_kv_heads, num_layers, num_planes, page_size, head_dim], contiguous
        if shared_fd >= 0:   # a tensor-parallel rank's pool, which rank 0 maps too (its KV transfer agent)
            whole = (fd_pages, *dims[1:])
            self._region, region = _shared_tensor(shared_fd, whole, dtype, fd_pages * self.page_bytes)
            self.storage = region[fd_first_page:fd_first_page + num_pages]   # contiguous: whole pages
            self.populating = None
        elif huge_pages and torch.device(device).type == "cpu":
            self._region, self.storage = _huge_page_tensor(dims, dtype, num_pages * self.page_bytes)
            self.populating = _populate_in_background(self.storage.data_ptr(), num_pages * self.page_bytes)
        else:
            self.storage = torch.empty(dims, dtype=dtype, device=device)
            self.populating = None
        if self.populating is None and shared_fd < 0:   # a fresh memfd reads as zeros already
            self.storage.zero_()
        # [num_layers, num_planes, num_pages, page_size, num_kv_heads, head_dim], a strided view of storage
        self.kv_cache = self.storage.permute(2, 3, 0, 4, 1, 5)

    @property
    def base_ptr(self) -> int:
        """Address of the region's first byte (what a NIXL agent registers)."""
        return int(self.storage.data_ptr())

    @property
    def nbytes(self) -> int:
        """Size of the region in bytes."""
        return int(self.storage.numel() * self.storage.element_size())

    def block_offset(self, page: PageId, head: int, layer: int, kv: int) -> int:
        """Byte offset from ``base_ptr`` of the block of page ``page``, local KV head ``head``, layer
        ``layer``, K (0) or V (1) (MLA: the latent, 0): ``block_bytes`` of ``page_size`` vectors.

        Raises:
            IndexError: an index outside the pool.
        """
        s = self.shape
        if not (0 <= layer < s.num_layers and 0 <= kv < s.num_planes and 0 <= page < self.num_pages
                and 0 <= head < s.num_kv_heads):
            raise IndexError(f"block (page={page}, head={head}, layer={layer}, kv={kv}) is outside the pool")
        index = ((page * s.num_kv_heads + head) * s.num_layers + layer) * s.num_planes + kv
        return index * self.block_bytes

    def page_offset(self, page: PageId) -> int:
        """Byte offset from ``base_ptr`` of page ``page`` (all its layers and planes: ``page_bytes``).

        Raises:
            IndexError: a page outside the pool.
        """
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is outside the pool")
        return page * self.page_bytes


def shared_pool_fd(nbytes: int) -> int:
    """A zeroed memfd of ``nbytes`` for a KV pool that two processes map (a tensor-parallel rank's, mapped by
    rank 0 for its transfer agent): close-on-exec, pass it with ``pass_fds``; owned by the caller. Raises
    OSError (no memfd, no memory)."""
    fd = os.memfd_create("triton-pd-kv-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _shared_tensor(fd: int, dims: tuple[int, ...], dtype: torch.dtype,
                   nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A host tensor of ``dims`` over a shared mapping of memfd ``fd`` (``nbytes``, ``shared_pool_fd``):
    what one process writes the others that map ``fd`` read. Returns (the mapping, which must outlive the
    tensor; the tensor). Raises OSError / ValueError when the descriptor is not a memfd of ``nbytes``."""
    region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(memoryview(region), dtype=torch.uint8, count=nbytes)
    return region, flat.view(dtype).view(dims)


def _huge_page_tensor(dims: tuple[int, ...], dtype: torch.dtype,
                      nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A host tensor of ``dims`` over a fresh anonymous mapping: starts on a 2 MiB boundary (the mapping is
    over-allocated by one huge page to find one), advised MADV_HUGEPAGE before any byte is touched. Returns
    (the mapping, which must outlive the tensor; the tensor)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    base = torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):   # Linux only
        region.madvise(mmap.MADV_HUGEPAGE, 0, len(region))
    flat = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
    return region, flat.view(dtype).view(dims)


_MADV_POPULATE_WRITE = 23  # linux/mman.h: fault pages in writable, contents unchanged (Linux 5.14+)
_POPULATE_CHUNK_BYTES = HUGE_PAGE_BYTES
#: ``madvise``'s system call number (asm/unistd_64.h; asm-generic/unistd.h for aarch64)
_SYS_MADVISE = {"x86_64": 28, "aarch64": 233}.get(os.uname().machine)


def _raw_madvise() -> Callable[[int, int, int], int]:
    """``madvise(addr, length, advice) -> 0 or -1 (errno set)`` as the raw system call (``syscall(2)``), not
    libc's ``madvise``: UCX (NIXL's UCX backend) live-patches libc's ``madvise``, ``mmap`` and the like when
    it starts (its UCM "bistro" memory hooks), and a thread parked inside one of those functions while its
    first bytes are rewritten resumes on half-written instructions (SIGSEGV or SIGILL: a known UCM race,
    openucx/ucx's ``test_hooks``). The populate thread spends the worker's start inside ``madvise`` calls of a
    few ms each, right when NIXL starts UCX; a decode stub died so once (2026-12-04, its fault handler's trace
    in ``populate``). ``syscall`` itself is not patched. Elsewhere (another architecture) libc's
    ``madvise``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if _SYS_MADVISE is None:
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    syscall = libc.syscall
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    syscall.restype = ctypes.c_long

    def madvise(addr: int, length: int, advice: int) -> int:
        return syscall(_SYS_MADVISE, addr, length, advice)

    return madvise


def _populate_in_background(base: int, nbytes: int) -> threading.Thread | None:
    """Start a daemon thread that faults in ``[base, base + nbytes)`` (page-aligned, a mapping of this
    process) with ``MADV_POPULATE_WRITE``, at nice 19 (it competed with the rest of a worker's start: the
    phase after the pool, NIXL's set-up, took 0.6 s before it and 1.7 s beside it on a quiet host). Returns
    the thread, or None when the kernel refuses the advice (tried on the first huge page, here): the caller
    then touches the memory itself. The thread holds no Python object of the pool: if the mapping is closed
    first, its madvise fails (ENOMEM) and it ends."""
    madvise = _raw_madvise()
    first = min(nbytes, HUGE_PAGE_BYTES)
    if madvise(base, first, _MADV_POPULATE_WRITE) != 0:
        return None

    def populate() -> None:   # ctypes releases the GIL for the call; the raw syscall: see ``_raw_madvise``
        try:   # lowest priority (Linux: per thread): a starting server's own work and its serving come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        # one huge page per call: each call holds the process's mmap lock, which every mmap (a library being
        # loaded, a large allocation) of the starting server's other threads waits for
        for offset in range(first, nbytes, _POPULATE_CHUNK_BYTES):
            if madvise(base + offset, min(_POPULATE_CHUNK_BYTES, nbytes - offset), _MADV_POPULATE_WRITE) != 0:
                logger.info("KV pool populate stopped: %s", os.strerror(ctypes.get_errno()))
                return

    thread = threading.Thread(target=populate, name="kv-pool-populate", daemon=True)
    thread.start()
    return thread


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
