"""The paged KV pool: one contiguous region per engine, page-major, laid out as in docs/architecture.md.

Memory order ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``: one page of every layer, K and
V, is one contiguous region of ``page_bytes``, so a prompt's pages move as one descriptor each however
scattered they are in the pool (with layer-major order a page was ``2 * num_layers`` separate blocks).
The model sees the same memory as ``kv_cache[l, kv, p, s, h, d]`` (a strided view): element ``d`` of head
``h`` of the K (``kv=0``) or V (``kv=1``) vector of the token in slot ``s`` of page ``p`` in layer ``l``.
The block of one (layer, kv, page) is contiguous; its byte offset from the region base is
``((p * num_layers + l) * 2 + kv) * block_bytes``, and page ``p`` starts at ``p * page_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.page_allocator import PageId


@dataclass(frozen=True)
class KVShape:
    """Model-side dimensions of the pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one (layer, kv, page) block: ``page_size * num_kv_heads * head_dim * itemsize``."""
        return self.page_size * self.num_kv_heads * self.head_dim * _itemsize(dtype)

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one page holds over all layers, K and V."""
        return 2 * self.num_layers * self.block_bytes(dtype)

    def pages_for_bytes(self, nbytes: int, dtype: torch.dtype) -> int:
        """Whole pages that fit in ``nbytes``."""
        return nbytes // self.page_bytes(dtype)


class KVPool:
    """Owns the KV tensor; allocated and written once (touched) at construction.

    Touching matters: the first write into never-touched memory is slow (page faults, ~10 ms per request seen
    when a transfer wrote into a fresh pool), so every byte is zeroed here, before serving.

    Attributes:
        storage: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, ``dtype``, ``device``,
            contiguous (the region a KV transport registers).
        kv_cache: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``, a strided view of
            ``storage`` (what the model indexes; never ``view`` it flat across pages).
        num_pages: pages in the pool.
        block_bytes: bytes of one (layer, kv, page) block.
        page_bytes: bytes of one page over all layers, K and V.
    """

    def __init__(self, shape: KVShape, num_pages: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_pages <= 0:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.shape = shape
        self.num_pages = num_pages
        self.dtype = dtype
        self.block_bytes = shape.block_bytes(dtype)
        self.page_bytes = shape.page_bytes(dtype)
        # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], contiguous
        self.storage = torch.empty(
            (num_pages, shape.num_layers, 2, shape.page_size, shape.num_kv_heads, shape.head_dim),
            dtype=dtype, device=device,
        )
        self.storage.zero_()
        # [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim], strided view of the same memory
        self.kv_cache = self.storage.permute(1, 2, 0, 3, 4, 5)

    @property
    def base_ptr(self) -> int:
        """Address of the region's first byte (what a NIXL agent registers)."""
        return int(self.storage.data_ptr())

    @property
    def nbytes(self) -> int:
        """Size of the region in bytes."""
        return int(self.storage.numel() * self.storage.element_size())

    def block_offset(self, layer: int, kv: int, page: PageId) -> int:
        """Byte offset from ``base_ptr`` of the block of page ``page``, layer ``layer``, K (0) or V (1).

        Raises:
            IndexError: an index outside the pool.
        """
        if not (0 <= layer < self.shape.num_layers and kv in (0, 1) and 0 <= page < self.num_pages):
            raise IndexError(f"block (layer={layer}, kv={kv}, page={page}) is outside the pool")
        return ((page * self.shape.num_layers + layer) * 2 + kv) * self.block_bytes

    def page_offset(self, page: PageId) -> int:
        """Byte offset from ``base_ptr`` of page ``page`` (all its layers, K and V: ``page_bytes``).

        Raises:
            IndexError: a page outside the pool.
        """
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is outside the pool")
        return page * self.page_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
