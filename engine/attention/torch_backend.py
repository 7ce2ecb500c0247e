"""Paged attention in plain torch for the CPU (and as a reference on any device).

Per step, ``prepare`` splits the batch into *decode buckets* (sequences with one new token) and *prefill
chunks* (a sequence with several new tokens), and precomputes what every layer reuses: page ids, masks and
output rows. Decode sequences are sorted by length and cut into buckets so that each bucket pads only to
its own longest member (the cut minimises padded pages plus a fixed per-bucket cost, ``_BUCKET_COST_PAGES``);
one bucket holding every sequence of equal length is the old single padded group. Per layer, ``forward``
writes the new K/V rows with one ``index_put_``, gathers each bucket's K/V whole (page, head) blocks at a
time (``index_select`` on the page dim, per KV head) and runs ``scaled_dot_product_attention`` with
``enable_gqa`` (kv head ``h // (num_heads // num_kv_heads)`` serves query head ``h``, as HF's ``repeat_kv``).
A single sequence whose pages are consecutive ids (the usual case for batch-1 decode and for a long prompt's
chunks, as the allocator hands out pages in order) reads a slice of the pool instead: one copy, no gather.
A chunk whose sequence has cached tokens uses a bottom-right-aligned causal mask (query ``i`` of a chunk of
``q`` tokens over ``s`` keys sees keys ``<= s - q + i``); a chunk without cache attends to its own K/V with
``is_causal``, skipping the gather.
MLA (``forward_latent``) runs the same buckets and chunks over the pool's one latent plane: a single KV head
whose keys are the latent and whose values are a view of its first ``value_dim`` elements (no copy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.base import AttentionBackend, write_kv_slots
from engine.forward_batch import ForwardBatch

# What one more decode bucket costs per layer (a gather and an SDPA call), in gathered pages; measured on
# SmolLM2-135M shapes (3 KV heads x 64, 16-token pages) at ~7 us per page and ~50 us per bucket.
_BUCKET_COST_PAGES = 8
# SDPA's kernels on CUDA without cuDNN's: torch 2.11 picks cuDNN attention for bf16 on an H200, which spent
# ~1.9 ms of CPU per call on decode shapes (the key length changes every step; a profile of 10 steps: 70 % of
# the CPU time, bf16 decode 79 ms per step against fp32's 21 on SmolLM2-135M shapes; without it 20.8 ms)
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    return sdpa_kernel(_CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class KVSource:
    """Where a group of ``batch`` sequences reads its K/V, padded to ``num_pages`` pages each.

    Attributes:
        first_page: the start of one run of consecutive page ids (``batch == 1``), read as a pool slice; or
            ``None`` when ``pages`` are gathered.
        pages: ``[batch * num_pages]`` int64 page ids (padding repeats page 0 and is masked out), or ``None``
            with ``first_page``.
        num_pages: pages per sequence.
        key_len: keys attended per sequence (the longest ``seq_len`` of the group).
    """

    first_page: int | None
    pages: torch.Tensor | None
    num_pages: int
    key_len: int

    def read(self, layer_kv: torch.Tensor, batch: int,
             value_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return K and V as ``[batch, kv_heads, key_len, head_dim]`` (copied once: pages of the page-major
        pool are not adjacent, so their tokens cannot be one strided view), each (sequence, head) block
        contiguous. ``value_dim`` (a one-plane MLA pool): V is a view of K's first ``value_dim`` elements.

        The pool is head-major inside a page (``engine.kv_pool``): a (page, head) block of ``page_size``
        vectors is contiguous, so a gather copies whole blocks, one ``index_select`` per head (one over all
        heads at once, along dim 1 of a permuted view, took 1.1 ms instead of 0.05 for 16 pages of SmolLM2's
        3 heads: torch's generic strided path)."""
        page_size, kv_heads, head_dim = layer_kv.shape[2:]
        planes = (0,) if value_dim is not None else (0, 1)
        n = self.num_pages
        out = []
        for i in planes:
            plane = layer_kv[i]   # [num_pages, page_size, kv_heads, head_dim], strided
            if self.first_page is not None:
                blocks = plane[self.first_page:self.first_page + n].permute(2, 0, 1, 3)  # [kv_heads, n, ...]
                heads = blocks.reshape(kv_heads, 1, n * page_size, head_dim)
            else:
                pages = self.pages
                assert pages is not None   # a gather names its pages: set whenever first_page is not
                gathered = plane.new_empty(kv_heads, batch * n, page_size, head_dim)
                for h in range(kv_heads):
                    torch.index_select(plane[:, :, h], 0, pages, out=gathered[h])
                heads = gathered.view(kv_heads, batch, n * page_size, head_dim)
            out.append(heads[:, :, :self.key_len].transpose(0, 1))
        k = out[0]
        return k, (out[1] if len(out) > 1 else k[..., :value_dim])


@dataclass
class DecodeBucket:
    """Sequences with one query token each, of similar lengths, attended in one SDPA call.

    Attributes:
        rows: ``[B]`` int64 token rows of the queries in the batch, or the slice ``0:B`` when they lead the
            batch in order.
        kv: where the bucket's K/V come from.
        mask: ``[B, 1, 1, key_len]`` bool, True where a key is attended; ``None`` when all lengths are equal.
    """

    rows: torch.Tensor | slice
    kv: KVSource
    mask: torch.Tensor | None


@dataclass
class PrefillSpan:
    """One sequence's chunk of ``end - start`` query tokens (rows ``start:end`` of the batch).

    Attributes:
        kv: where the sequence's ``seq_len`` keys come from, or ``None`` when nothing is cached (the chunk
            then attends to its own K/V with ``is_causal``).
        mask: ``[q, seq_len]`` bool causal mask aligned bottom-right, or ``None`` when nothing is cached.
    """

    start: int
    end: int
    kv: KVSource | None
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    """What ``TorchAttentionBackend.prepare`` computes once per step."""

    slot_mapping: torch.Tensor
    decodes: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def _used_pages(pages: list[int], seq_len: int, page_size: int) -> list[int]:
    needed = -(-seq_len // page_size)
    if len(pages) < needed:
        raise ValueError(f"page table of {len(pages)} pages too short for seq_len={seq_len} "
                         f"(page_size={page_size})")
    return pages[:needed]


def _kv_source(used: list[list[int]], key_len: int, device: torch.device) -> KVSource:
    num_pages = max(len(u) for u in used)
    if len(used) == 1 and used[0] == list(range(used[0][0], used[0][0] + num_pages)):
        return KVSource(used[0][0], None, num_pages, key_len)
    flat = [p for u in used for p in u + [0] * (num_pages - len(u))]
    return KVSource(None, torch.tensor(flat, dtype=torch.int64, device=device), num_pages, key_len)


def _bucket_bounds(page_counts: list[int]) -> list[int]:
    """Cut ``page_counts`` (ascending) into runs minimising padded pages + ``_BUCKET_COST_PAGES`` per run
    (a run pads to its last, largest count); returns the run ends. O(n^2) over one batch's sequences."""
    best, cut = [0], [0]
    for j in range(1, len(page_counts) + 1):
        costs = [best[i] + (j - i) * page_counts[j - 1] + _BUCKET_COST_PAGES for i in range(j)]
        cut.append(min(range(j), key=costs.__getitem__))
        best.append(costs[cut[-1]])
    ends, j = [], len(page_counts)
    while j:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


def _decode_bucket(rows: list[int], lens: list[int], used: list[list[int]],
                   device: torch.device) -> DecodeBucket:
    key_len = max(lens)
    mask = None
    if min(lens) != key_len:
        lens_t = torch.tensor(lens, device=device)
        mask = torch.arange(key_len, device=device)[None, :] < lens_t[:, None]
        mask = mask.view(len(lens), 1, 1, key_len)
    leading = rows == list(range(len(rows)))
    row_index = slice(0, len(rows)) if leading else torch.tensor(rows, dtype=torch.int64, device=device)
    return DecodeBucket(row_index, _kv_source(used, key_len, device), mask)


def _decode_buckets(rows: list[int], lens: list[int], tables: list[list[int]], page_size: int,
                    device: torch.device) -> list[DecodeBucket]:
    used = [_used_pages(pages, n, page_size) for pages, n in zip(tables, lens)]
    order = sorted(range(len(rows)), key=lambda i: (len(used[i]), lens[i]))
    buckets, start = [], 0
    for end in _bucket_bounds([len(used[i]) for i in order]):
        part = order[start:end] if end - start < len(order) else list(range(len(order)))  # keep batch order
        buckets.append(_decode_bucket([rows[i] for i in part], [lens[i] for i in part],
                                      [used[i] for i in part], device))
        start = end
    return buckets


def _prefill_chunk(start: int, q_len: int, seq_len: int, pages: list[int], page_size: int,
                   device: torch.device) -> PrefillSpan:
    if q_len == seq_len:
        return PrefillSpan(start, start + q_len, None, None)
    kv = _kv_source([_used_pages(pages, seq_len, page_size)], seq_len, device)
    key_pos = torch.arange(seq_len, device=device)[None, :]
    query_pos = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    return PrefillSpan(start, start + q_len, kv, key_pos <= query_pos)


class TorchAttentionBackend(AttentionBackend):
    """CPU-friendly paged attention with SDPA; see the module docstring for the algorithm."""

    def prepare(self, batch: ForwardBatch, page_size: int) -> TorchAttentionMetadata:
        device = batch.slot_mapping.device
        d_rows: list[int] = []
        d_lens: list[int] = []
        d_tables: list[list[int]] = []
        prefills: list[PrefillSpan] = []
        start = 0
        for q_len, seq_len, pages in zip(batch.query_lens, batch.seq_lens, batch.page_tables):
            if q_len == 1:
                d_rows.append(start)
                d_lens.append(seq_len)
                d_tables.append(pages)
            else:
                prefills.append(_prefill_chunk(start, q_len, seq_len, pages, page_size, device))
            start += q_len
        decodes = _decode_buckets(d_rows, d_lens, d_tables, page_size, device) if d_rows else []
        return TorchAttentionMetadata(batch.slot_mapping, decodes, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_slots(layer_kv, metadata.slot_mapping, k, v)
        return self._attend(q, k, v, layer_kv, metadata, scale, None)

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_kv: torch.Tensor,
                       metadata: TorchAttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        write_kv_slots(layer_kv, metadata.slot_mapping, latent, None)
        return self._attend(q, latent, latent[..., :value_dim], layer_kv, metadata, scale, value_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float, value_dim: int | None) -> torch.Tensor:
        num_tokens, num_heads = q.shape[:2]
        decodes = metadata.decodes
        if len(decodes) == 1 and not metadata.prefills and isinstance(decodes[0].rows, slice):
            return self._decode(q, layer_kv, decodes[0], scale, value_dim)  # rows 0:B are the whole batch
        out = q.new_empty(num_tokens, num_heads * v.shape[-1])
        for bucket in decodes:
            out[bucket.rows] = self._decode(q[bucket.rows], layer_kv, bucket, scale, value_dim)
        for chunk in metadata.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, layer_kv, chunk, scale, value_dim)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, layer_kv: torch.Tensor, d: DecodeBucket, scale: float,
                value_dim: int | None) -> torch.Tensor:
        batch = q.shape[0]
        keys, values = d.kv.read(layer_kv, batch, value_dim)  # [batch, kv_heads, key_len, head_dim]
        query = q.unsqueeze(2)
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            # torch's CPU SDPA in bf16 runs ~4.3x slower than in fp32 on these shapes (a 16-sequence decode
            # step of SmolLM2-135M: 45.7 against 10.6 ms): widen; the scores and the softmax are then fp32,
            # as the math path's would be
            query, keys, values = query.float(), keys.float(), values.float()
        with _sdpa_backends(q.device):
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=d.mask, scale=scale,
                                                 enable_gqa=True)  # [batch, num_heads, 1, v head_dim]
        return out.to(q.dtype).reshape(batch, -1)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                 chunk: PrefillSpan, scale: float, value_dim: int | None) -> torch.Tensor:
        qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
        if chunk.kv is None:
            keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, head_dim]
            values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            keys, values = chunk.kv.read(layer_kv, 1, value_dim)  # [1, kv_heads, seq_len, head_dim]
        with _sdpa_backends(q.device):
            out = F.scaled_dot_product_attention(qc, keys, values, attn_mask=chunk.mask,
                                                 is_causal=chunk.kv is None, scale=scale,
                                                 enable_gqa=True)  # [1, num_heads, q_len, head_dim]
        return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)
