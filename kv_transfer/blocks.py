"""Descriptor index space of one instance's registered memory: every KV page, then every aux slot.

Index ``page`` is the whole page (every head and layer, K and V: ``page_bytes`` at ``page * page_bytes``, the
pool being page-major, docs/architecture.md); index ``num_pages + slot`` is aux slot ``slot``. Every transport
takes transfers as (local indices, remote indices) pairs in this space: NIXL prepares the whole list once per
agent (and merges runs that are contiguous on both sides at transfer time); Mooncake and the in-process
transport turn indices into addresses and merge such runs themselves (``merge_runs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.head_slices import KVRegion, page_spans
from kv_transfer.layout import KVLayout, PageId


@dataclass(frozen=True)
class BlockTable:
    """One instance's registered memory. ``regions``: a tensor-parallel instance's rank pools
    (``kv_transfer.head_slices``; ``kv_base_ptr`` is the first one's, ``layout.num_kv_heads`` the model's);
    empty: one pool of every head at ``kv_base_ptr``. With regions, the descriptor index space's KV pages are
    the first region's (what it registers as a list), and KV moves as head-sliced spans only."""

    kv_base_ptr: int
    layout: KVLayout
    aux_base_ptr: int
    aux_slots: int
    regions: tuple[KVRegion, ...] = ()

    @property
    def kv_regions(self) -> tuple[KVRegion, ...]:
        """Every KV pool: ``regions``, or the one pool of every head."""
        return self.regions or (KVRegion(0, self.layout.num_kv_heads, self.kv_base_ptr),)

    @property
    def sliced(self) -> bool:
        """Whether the KV is split over several pools (a tensor-parallel instance): whole-page descriptors
        then do not name a token's KV."""
        return bool(self.regions)

    def region_spans(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every KV pool, in region order: what a transport registers besides the aux
        slots (all in ``mem_type``)."""
        return [(r.base_ptr, r.layout(self.layout).pool_bytes) for r in self.kv_regions]

    @property
    def num_kv_descs(self) -> int:
        """KV descriptors: one per page."""
        return self.layout.num_pages

    @property
    def kv_desc_bytes(self) -> int:
        """Bytes of one KV descriptor (a whole page; of the first region's pool when sliced)."""
        return self.kv_regions[0].layout(self.layout).page_bytes

    @property
    def num_descriptors(self) -> int:
        return self.num_kv_descs + self.aux_slots

    def kv_indices(self, pages: Sequence[PageId], aux_slot: int | None = None) -> np.ndarray:
        """Indices of ``pages``: int64 ``[len(pages)]`` (one descriptor per page), in order; with
        ``aux_slot``, that slot's index appended. Raises ``ValueError`` for a page or slot out of range."""
        out = np.empty(len(pages) + (aux_slot is not None), dtype=np.int64)
        out[:len(pages)] = pages
        if len(pages) and (out[:len(pages)].min() < 0 or out[:len(pages)].max() >= self.layout.num_pages):
            raise ValueError(f"page ids out of range [0, {self.layout.num_pages})")
        if aux_slot is not None:
            out[-1] = self.aux_index(aux_slot)
        return out

    def aux_index(self, slot: int) -> int:
        if not 0 <= slot < self.aux_slots:
            raise ValueError(f"aux slot {slot} out of range [0, {self.aux_slots})")
        return self.num_kv_descs + slot

    def spans(self, indices: np.ndarray) -> np.ndarray:
        """(address, nbytes) of each index: int64 ``[len(indices), 2]``."""
        is_aux = indices >= self.num_kv_descs
        addr = np.where(is_aux, self.aux_base_ptr + (indices - self.num_kv_descs) * AUX_SLOT_BYTES,
                        self.kv_base_ptr + indices * self.kv_desc_bytes)
        nbytes = np.where(is_aux, AUX_SLOT_BYTES, self.kv_desc_bytes)
        return np.stack([addr, nbytes], axis=1).astype(np.int64)

    def partial_page_spans(self, page: PageId, num_tokens: int) -> np.ndarray:
        """(address, nbytes) of the first ``num_tokens`` token slots of ``page`` in every (head, layer,
        plane) block (planes: K and V, or the MLA latent): int64 ``[num_kv_heads * num_layers * num_planes,
        2]``, in address order (``head_slices.page_spans``; a whole page: one span). A page whose last slots
        hold no KV yet (a prompt's last page) is sent as these spans instead of the whole page. Raises
        ``ValueError`` for a page out of range or ``num_tokens`` outside ``[1, page_size]``."""
        layout = self.layout
        if not 0 <= page < layout.num_pages or not 1 <= num_tokens <= layout.page_size:
            raise ValueError(f"page {page} / {num_tokens} tokens out of range")
        return page_spans(self.kv_base_ptr, layout, np.array([page], dtype=np.int64),
                          np.array([num_tokens], dtype=np.int64), 0, layout.num_kv_heads)

    def pages_spans(self, pages: Sequence[PageId], last_page_tokens: int) -> np.ndarray:
        """(address, nbytes) of ``pages`` whose last page holds only ``last_page_tokens`` tokens: the whole
        pages before it (one span each), then that page's filled slots (``partial_page_spans``): int64
        ``[len(pages) - 1 + num_planes * num_layers, 2]``. Raises ``ValueError`` as ``kv_indices`` and
        ``partial_page_spans`` do, and for no pages."""
        if not pages:
            raise ValueError("no pages")
        return np.concatenate([self.spans(self.kv_indices(pages[:-1])),
                               self.partial_page_spans(pages[-1], last_page_tokens)])

    def descriptors(self, start: int, stop: int, device_id: int = 0) -> np.ndarray:
        """Descriptors of indices ``[start, stop)``: int64 ``[stop - start, 3]`` (address, nbytes,
        device id)."""
        spans = self.spans(np.arange(start, stop, dtype=np.int64))
        return np.hstack([spans, np.full((len(spans), 1), device_id, dtype=np.int64)])


class Runs(NamedTuple):
    """Copies after merging: int64 ``[n]`` source addresses, destination addresses, lengths in bytes."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    nbytes: np.ndarray


def merge_runs(src: np.ndarray, dst: np.ndarray) -> Runs:
    """Merges pairwise copies ``src[i] -> dst[i]`` (int64 ``[n, 2]`` (address, nbytes) spans, equal sizes
    pairwise) into the fewest copies: neighbours contiguous on both sides become one run. Pages a long-running
    pool hands out are scattered, so this is what turns a prompt's pages into a few large descriptors where
    the pages happen to be adjacent on both sides. Raises ``ValueError`` when sizes differ pairwise."""
    if len(src) != len(dst) or not np.array_equal(src[:, 1], dst[:, 1]):
        raise ValueError("source and destination spans differ in count or size")
    if len(src) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    ends = src[:-1, 0] + src[:-1, 1]
    breaks = (src[1:, 0] != ends) | (dst[1:, 0] != dst[:-1, 0] + dst[:-1, 1])
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return Runs(src[starts, 0].copy(), dst[starts, 0].copy(), np.add.reduceat(src[:, 1], starts))
