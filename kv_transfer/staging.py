"""Re-layout on the sending side for KV between instances whose KV heads are split over ranks differently
(issue #45; docs/parallelism.md, "PD between different TP sizes").

Inside a page's (layer, plane) block a token's heads are contiguous, so a destination rank holding other heads
than a source rank wants one 256-512 B span per (page, layer, plane, token): a 4k-token room of SmolLM2 was
491,520 descriptors, and the transport handled each as its own copy (0.036x of TP=1's speed, commit 2669f25).
Instead the prefill side, whose process maps every rank's pool, copies the heads each destination region holds
into a registered staging area laid out as that region's pages (``pack``: one numpy copy per source region and
run of pages, a strided copy into a cache-sized buffer), then WRITEs those pages whole (``piece_blocks``: a
piece of whole pages as equal blocks, which a transport may split between its copy threads). A destination
region holding exactly a source region's heads gets that region's pages directly (no staging).
Nothing about either instance's layout changes: each side still registers and advertises its own pools.

A ``StagedPlan`` is the work of one chunk: the direct spans and the pieces, each piece at most half the
staging area, for one destination region. ``PrefillSide`` packs each piece into one half while the transport
writes the other, waits for a half's WRITE before packing it again, and posts the chunk's notification only
after every piece's WRITE is done.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kv_transfer.head_slices import KVRegion
from kv_transfer.layout import KVLayout, PageId

#: Default size of a prefill instance's staging area (``KVArgs.staging_bytes``), two halves: a half holds
#: several pages (16 blocks or more per piece), and sizes of 4, 16 and 32 MiB were no better here
#: (docs/benchmarks.md, "KV between prefill and decode of different TP sizes").
DEFAULT_STAGING_BYTES = 8 << 20
HUGE_PAGE_BYTES = 2 << 20


class StagingBuffer:
    """Host memory a prefill manager registers beside its KV pools: ``nbytes`` rounded up to whole 2 MiB huge
    pages, on a 2 MiB boundary, advised ``MADV_HUGEPAGE`` (UCX's ``cma`` copy out of 4 KiB pages ran at about
    half the speed of one out of the engine's huge-page pools), touched once at construction so that no
    transfer pays its first-touch page faults. Used only under the transport's lock (one staged chunk at a
    time). Raises ``ValueError`` for ``nbytes`` <= 0."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging area of {nbytes} bytes")
        nbytes = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        self._region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):   # Linux only; before any byte is touched
            self._region.madvise(mmap.MADV_HUGEPAGE, 0, len(self._region))
        whole = np.frombuffer(self._region, dtype=np.uint8)
        offset = -int(whole.ctypes.data) % HUGE_PAGE_BYTES
        self.data = whole[offset:offset + nbytes]   # [nbytes] uint8; the mapping lives as long as this object
        self.data.fill(1)   # faults every page in now

    @property
    def base_ptr(self) -> int:
        return int(self.data.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class StagedPiece:
    """One staged WRITE: destination region ``dst_index`` gets source pages ``src_pages`` (int64 ``[n]``) as
    its pages ``dst_pages`` (int64 ``[n]``), packed at the start of the staging area; when
    ``last_page_tokens`` is set, the piece's last page holds only that many tokens and only their slots are
    written."""

    dst_index: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    last_page_tokens: int | None


@dataclass(frozen=True)
class StagedPlan:
    """The copies of one chunk. ``direct_src``/``direct_dst``: int64 ``[n, 2]`` (address, nbytes) spans moved
    as they are (destination regions holding exactly a source region's heads); ``pieces``: what goes through
    the staging area; ``kv_bytes``: the KV bytes both together move into the destination."""

    direct_src: np.ndarray
    direct_dst: np.ndarray
    pieces: tuple[StagedPiece, ...]
    kv_bytes: int


def _sources(src: Sequence[KVRegion], dst: KVRegion) -> list[tuple[KVRegion, int, int]]:
    """(source region, first head, stop head) covering ``dst``'s heads, each head from the first source region
    holding it. Raises ``ValueError`` for a head no source region holds."""
    out, head = [], dst.head_start
    while head < dst.head_stop:
        s = next((r for r in src if r.head_start <= head < r.head_stop), None)
        if s is None:
            raise ValueError(f"KV head {head} is held by no source region")
        stop = min(dst.head_stop, s.head_stop)
        out.append((s, head, stop))
        head = stop
    return out


def _page_spans(region: KVRegion, layout: KVLayout, pages: np.ndarray, last_page_tokens: int | None,
                base_ptr: int | None = None) -> np.ndarray:
    """(address, nbytes) of ``pages`` of ``region`` (or of pages ``0..n-1`` of the same layout at
    ``base_ptr``: the staging area): one span per whole page, and per (layer, plane) block of a last page that
    holds only ``last_page_tokens`` tokens. int64 ``[m, 2]``."""
    local = region.layout(layout)
    at = (np.arange(len(pages), dtype=np.int64) * local.page_bytes + base_ptr if base_ptr is not None
          else region.base_ptr + pages * local.page_bytes)
    if last_page_tokens is None or last_page_tokens == layout.page_size:
        return np.stack([at, np.full_like(at, local.page_bytes)], axis=1)
    blocks = at[-1] + np.arange(layout.num_layers * layout.num_planes, dtype=np.int64) * local.block_bytes
    tail = np.stack([blocks, np.full_like(blocks, last_page_tokens * local.block_bytes // layout.page_size)],
                    axis=1)
    whole = np.stack([at[:-1], np.full_like(at[:-1], local.page_bytes)], axis=1)
    return np.concatenate([whole, tail])


def plan(layout: KVLayout, src: Sequence[KVRegion], dst: Sequence[KVRegion], src_pages: Sequence[PageId],
         dst_pages: Sequence[PageId], last_page_tokens: int | None, staging_bytes: int) -> StagedPlan:
    """The copies that put source pages ``src_pages`` (an instance of regions ``src``, this process's) into
    destination pages ``dst_pages`` (regions ``dst``), as ``head_slices.head_sliced_spans`` defines them,
    through a staging area of ``staging_bytes``. ``layout`` is the instance layout (``num_kv_heads``: the
    model's). Raises ``ValueError`` when the page lists differ in length, a destination head has no source, or
    a destination region's page does not fit the staging area."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    sp, dp = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    direct_src, direct_dst, pieces, kv_bytes = [], [], [], 0
    for index, d in enumerate(dst):
        sources = _sources(src, d)
        if not len(sp):
            continue
        same_heads = (sources[0][0].head_start, sources[0][0].head_stop) == (d.head_start, d.head_stop)
        if len(sources) == 1 and same_heads:
            direct_src.append(_page_spans(sources[0][0], layout, sp, last_page_tokens))
            direct_dst.append(_page_spans(d, layout, dp, last_page_tokens))
            kv_bytes += int(direct_dst[-1][:, 1].sum())
            continue
        page_bytes = d.layout(layout).page_bytes
        per_piece = staging_bytes // page_bytes
        if per_piece < 1:
            raise ValueError(f"a page of {page_bytes} bytes does not fit the staging area of {staging_bytes}")
        for start in range(0, len(sp), per_piece):
            stop = min(start + per_piece, len(sp))
            tokens = last_page_tokens if stop == len(sp) else None
            pieces.append(StagedPiece(index, sp[start:stop], dp[start:stop], tokens))
            kv_bytes += (stop - start - (tokens is not None)) * page_bytes
            if tokens is not None:
                kv_bytes += tokens * page_bytes // layout.page_size
    empty = np.zeros((0, 2), dtype=np.int64)
    return StagedPlan(np.concatenate(direct_src) if direct_src else empty,
                      np.concatenate(direct_dst) if direct_dst else empty.copy(), tuple(pieces), kv_bytes)


def _head_dtype(layout: KVLayout) -> np.dtype:
    """One KV head of one token as one opaque numpy element (``head_dim * itemsize`` bytes): numpy then copies
    a run of heads with one inner-loop call per token instead of one per value (measured: the fastest of
    float32, 8-byte words and this)."""
    return np.dtype((np.void, layout.head_dim * layout.itemsize_bytes))


def _pool_view(region: KVRegion, layout: KVLayout) -> np.ndarray:
    """``region``'s pool (this process's memory) as ``[num_pages, num_layers * num_planes, page_size,
    num_heads]`` of ``_head_dtype``."""
    local = region.layout(layout)
    raw = (ctypes.c_uint8 * local.pool_bytes).from_address(region.base_ptr)
    return np.frombuffer(memoryview(raw), dtype=_head_dtype(layout)).reshape(
        local.num_pages, layout.num_layers * layout.num_planes, layout.page_size, local.num_kv_heads)


def _runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(first page, index in ``pages``, length) of each run of consecutive page ids."""
    if not len(pages):
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    stops = np.concatenate((breaks, [len(pages)])).astype(np.int64)
    return [(int(pages[a]), int(a), int(b - a)) for a, b in zip(starts, stops)]


def pack(piece: StagedPiece, layout: KVLayout, src: Sequence[KVRegion], dst: Sequence[KVRegion],
         staging: StagingBuffer, half: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Copies ``piece``'s heads from the source pools into half ``half`` (0 or 1) of the staging area (as
    destination region ``piece.dst_index``'s pages ``0..n-1``) and returns the WRITE: (local spans in the
    staging area, remote spans in the destination region), int64 ``[m, 2]`` (address, nbytes) each, one per
    page (per block of a partly filled last page). Pieces come from ``plan`` given half the staging area, so
    one half can be packed while the other is written. Runs on the caller's thread; numpy releases the GIL
    for the copies."""
    d = dst[piece.dst_index]
    local = d.layout(layout)
    n = len(piece.src_pages)
    start = half * (staging.nbytes // 2)
    heads = staging.data[start:start + n * local.page_bytes].view(_head_dtype(layout))
    out = heads.reshape(n, layout.num_layers * layout.num_planes, layout.page_size, local.num_kv_heads)
    for s, head, stop in _sources(src, d):
        view = _pool_view(s, layout)
        a, b = head - s.head_start, stop - s.head_start
        for first, at, length in _runs(piece.src_pages):
            out[at:at + length, :, :, head - d.head_start:stop - d.head_start] = (
                view[first:first + length, :, :, a:b])
    return (_page_spans(d, layout, piece.dst_pages, piece.last_page_tokens,
                        base_ptr=staging.base_ptr + start),
            _page_spans(d, layout, piece.dst_pages, piece.last_page_tokens))



class PieceBlocks(NamedTuple):
    """A packed piece's WRITE as equal blocks (``Transport.post_write_blocks``'s arguments after the peer):
    the local area (the staging half, (address, nbytes)) and the remote one (the destination region's pool),
    ``block_bytes``, and the block indices in each (int64 ``[n]``)."""

    local_area: tuple[int, int]
    remote_area: tuple[int, int]
    block_bytes: int
    local_blocks: np.ndarray
    remote_blocks: np.ndarray


def piece_blocks(piece: StagedPiece, layout: KVLayout, dst: Sequence[KVRegion], staging: StagingBuffer,
                 half: int, min_blocks: int) -> PieceBlocks | None:
    """``piece``'s WRITE after ``pack(..., half)`` as blocks: each page cut into the fewest whole (layer,
    plane) groups that give at least ``min_blocks`` blocks (a transport splits a WRITE between threads by
    descriptor count), or None for a piece whose last page is partly filled (its spans are not equal
    blocks)."""
    if piece.last_page_tokens is not None and piece.last_page_tokens != layout.page_size:
        return None
    d = dst[piece.dst_index]
    local = d.layout(layout)
    n, groups = len(piece.src_pages), layout.num_layers * layout.num_planes
    k = next((k for k in range(1, groups + 1) if groups % k == 0 and n * k >= min_blocks), groups)
    half_bytes = staging.nbytes // 2
    parts = np.arange(k, dtype=np.int64)
    return PieceBlocks((staging.base_ptr + half * half_bytes, half_bytes), (d.base_ptr, local.pool_bytes),
                       local.page_bytes // k, np.arange(n * k, dtype=np.int64),
                       (piece.dst_pages[:, None] * k + parts[None, :]).reshape(-1))
