"""KV heads split over the ranks of a tensor-parallel instance, and the head-sliced copies between two such
instances of different TP sizes (issue #45; docs/parallelism.md, "PD between different TP sizes").

A tensor-parallel instance's KV is one pool per rank, each page-major and head-major inside a page
(``kv_transfer.layout``) over the KV heads that rank holds, all with the same page ids. ``KVRegion`` names
one: model KV heads ``[head_start, head_stop)`` at ``base_ptr``. An instance's regions cover every model KV
head at least once (more than once where heads are replicated). Inside a region's page the heads ``[a, b)``
are one range of ``(b - a) * page_head_bytes``, so a copy between two regions moves one span per (page,
head range): a 4k-token room of SmolLM2 from P TP=2 to D TP=1 is 512 spans of 120-240 KiB (with version 2's
heads innermost it was 491,520 spans of 256-512 B). A prompt's partly filled last page moves its filled
token slots only: one span per (head, layer, plane). ``merge_runs`` joins what is contiguous on both sides.

Each destination region receives each of its heads once, from the first source region that holds it: no byte
is moved twice but into a replica (a decode whose KV heads are replicated gets each replica written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kv_transfer.layout import KVLayout, PageId


@dataclass(frozen=True)
class KVRegion:
    """One rank's KV pool: model KV heads ``[head_start, head_stop)`` (local heads ``0..stop-start-1``) in a
    page-major pool of the instance's ``num_pages`` pages at address ``base_ptr``."""

    head_start: int
    head_stop: int
    base_ptr: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start

    def layout(self, instance: KVLayout) -> KVLayout:
        """The instance layout (``num_kv_heads``: the model's) narrowed to this region's heads."""
        return replace(instance, num_kv_heads=self.num_heads)

    def to_json(self) -> list[int]:
        return [self.head_start, self.head_stop, self.base_ptr]

    @classmethod
    def from_json(cls, data: Sequence[int]) -> KVRegion:
        """Raises ValueError / TypeError for anything but three integers."""
        start, stop, base = (int(x) for x in data)
        return cls(start, stop, base)


def coverage_problem(regions: Sequence[KVRegion], num_kv_heads: int) -> str | None:
    """Why ``regions`` cannot be an instance's KV of ``num_kv_heads`` model heads (an empty or out-of-range
    head range, a head no region holds, a null address), or None when they can."""
    if not regions:
        return "no KV region"
    held = np.zeros(num_kv_heads, dtype=bool)
    for r in regions:
        if not 0 <= r.head_start < r.head_stop <= num_kv_heads or r.base_ptr <= 0:
            return (f"region heads [{r.head_start}, {r.head_stop}) at {r.base_ptr:#x} outside "
                    f"[0, {num_kv_heads})")
        held[r.head_start:r.head_stop] = True
    if not held.all():
        return f"KV heads {np.flatnonzero(~held).tolist()} are held by no rank"
    return None


def page_spans(base_ptr: int, layout: KVLayout, pages: np.ndarray, num_tokens: np.ndarray, head: int,
               num_heads: int) -> np.ndarray:
    """(address, nbytes) of local KV heads ``[head, head + num_heads)`` of pages ``pages`` (int64 ``[n]``) of
    the pool at ``base_ptr`` laid out as ``layout`` (its ``num_kv_heads``: the pool's own), every layer and
    plane, of which page ``pages[i]`` holds ``num_tokens[i]`` tokens (int64 ``[n]``, ``1..page_size``): one
    span per whole page (the head range is contiguous), in page order, then one per (head, layer, plane) of
    each partly filled page (its first ``num_tokens[i]`` slots), in (page, head, layer, plane) order; two
    calls with the same ``num_tokens`` pair span for span. int64 ``[m, 2]``."""
    partial = num_tokens < layout.page_size
    start = base_ptr + pages * layout.page_bytes + head * layout.page_head_bytes
    whole = start[~partial]
    spans = np.stack([whole, np.full_like(whole, num_heads * layout.page_head_bytes)], axis=1)
    if not partial.any():
        return spans
    blocks = np.arange(num_heads * layout.num_layers * layout.num_planes, dtype=np.int64) * layout.block_bytes
    addr = (start[partial][:, None] + blocks[None, :]).reshape(-1)
    nbytes = np.repeat(num_tokens[partial] * (layout.block_bytes // layout.page_size), len(blocks))
    return np.concatenate([spans, np.stack([addr, nbytes], axis=1)])


def _region_spans(region: KVRegion, layout: KVLayout, pages: np.ndarray, num_tokens: np.ndarray,
                  head_start: int, num_heads: int) -> np.ndarray:
    """``page_spans`` of model heads ``[head_start, head_start + num_heads)`` held by ``region``."""
    return page_spans(region.base_ptr, region.layout(layout), pages, num_tokens,
                      head_start - region.head_start, num_heads)


def head_sliced_spans(layout: KVLayout, src: Sequence[KVRegion], dst: Sequence[KVRegion],
                      src_pages: Sequence[PageId], dst_pages: Sequence[PageId],
                      last_page_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The copies that put source pages ``src_pages`` (an instance of regions ``src``) into destination pages
    ``dst_pages`` (regions ``dst``), every destination region getting each of its heads from the first source
    region holding it; the last page holds only ``last_page_tokens`` tokens (None: whole). Returns (source
    spans, destination spans): int64 ``[n, 2]`` (address, nbytes), pairwise equal sizes, contiguous neighbours
    merged. ``layout`` is the instance layout (``num_kv_heads``: the model's). Raises ``ValueError`` when the
    page lists differ in length or a destination head has no source."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    sp, dp = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    ntok = np.full(len(sp), layout.page_size, dtype=np.int64)
    if len(ntok) and last_page_tokens is not None:
        ntok[-1] = last_page_tokens
    parts_src, parts_dst = [], []
    for d in dst:
        head = d.head_start
        while head < d.head_stop:
            s = next((r for r in src if r.head_start <= head < r.head_stop), None)
            if s is None:
                raise ValueError(f"KV head {head} is held by no source region")
            stop = min(d.head_stop, s.head_stop)
            parts_src.append(_region_spans(s, layout, sp, ntok, head, stop - head))
            parts_dst.append(_region_spans(d, layout, dp, ntok, head, stop - head))
            head = stop
    if not parts_src or not len(sp):
        empty = np.zeros((0, 2), dtype=np.int64)
        return empty, empty.copy()
    from kv_transfer.blocks import merge_runs

    runs = merge_runs(np.concatenate(parts_src), np.concatenate(parts_dst))
    return (np.stack([runs.src_addrs, runs.nbytes], axis=1), np.stack([runs.dst_addrs, runs.nbytes], axis=1))
