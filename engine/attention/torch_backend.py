"""Paged attention in plain torch for the CPU (and as a reference on any device).

Per step, ``prepare`` sorts the batch into one *decode group* (every sequence with one new token, padded to
the longest KV length with a key mask) and a list of *prefill chunks* (a sequence with several new tokens),
and precomputes the page ids each of them gathers. Per layer, ``forward`` writes the new K/V rows with one
``index_copy_``, gathers each group's K/V whole pages at a time (``index_select`` on the page dim), and runs
``scaled_dot_product_attention`` with ``enable_gqa`` (kv head ``h // (num_heads // num_kv_heads)`` serves
query head ``h``, as HF's ``repeat_kv``).
A chunk whose sequence has cached tokens uses a bottom-right-aligned causal mask (query ``i`` of a chunk of
``q`` tokens over ``s`` keys sees keys ``<= s - q + i``); a chunk without cache attends to its own K/V with
``is_causal``, skipping the gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch


@dataclass
class DecodeGroup:
    """Sequences with one query token each, their KV gathered page by page and padded to ``max_pages``.

    Attributes:
        rows: ``[B]`` int64 token rows of the queries in the batch, or the slice ``0:B`` when they lead the
            batch.
        pages: ``[B * max_pages]`` int64 page ids (padding repeats page 0 and is masked out).
        max_pages: pages of the longest sequence.
        key_len: keys attended per sequence after the gather (``max_len`` when all lengths are equal, else
            ``max_pages * page_size``).
        mask: ``[B, 1, 1, key_len]`` bool, True where a key is attended; ``None`` when all lengths are equal.
    """

    rows: torch.Tensor | slice
    pages: torch.Tensor
    max_pages: int
    key_len: int
    mask: torch.Tensor | None


@dataclass
class PrefillSpan:
    """One sequence's chunk of ``end - start`` query tokens (rows ``start:end`` of the batch).

    Attributes:
        pages: ``[ceil(seq_len / page_size)]`` int64 page ids of the sequence, or ``None`` when nothing is
            cached (the chunk then attends to its own K/V with ``is_causal``).
        seq_len: KV length after this chunk, in tokens.
        mask: ``[q, seq_len]`` bool causal mask aligned bottom-right, or ``None`` when nothing is cached.
    """

    start: int
    end: int
    pages: torch.Tensor | None
    seq_len: int
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    """What ``TorchAttentionBackend.prepare`` computes once per step."""

    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillSpan] = field(default_factory=list)


def _used_pages(pages: list[int], seq_len: int, page_size: int) -> list[int]:
    needed = -(-seq_len // page_size)
    if len(pages) < needed:
        raise ValueError(f"page table of {len(pages)} pages too short for seq_len={seq_len} "
                         f"(page_size={page_size})")
    return pages[:needed]


def _decode_group(rows: list[int], lens: list[int], tables: list[list[int]], page_size: int,
                  device: torch.device) -> DecodeGroup:
    used = [_used_pages(pages, n, page_size) for pages, n in zip(tables, lens)]
    max_pages = max(len(u) for u in used)
    flat = [p for u in used for p in u + [0] * (max_pages - len(u))]
    mask = None
    key_len = max(lens)
    if min(lens) != key_len:
        key_len = max_pages * page_size
        lens_t = torch.tensor(lens, device=device)
        mask = torch.arange(key_len, device=device)[None, :] < lens_t[:, None]  # [B, key_len]
        mask = mask.view(len(lens), 1, 1, key_len)
    leading = rows == list(range(len(rows)))
    row_index = slice(0, len(rows)) if leading else torch.tensor(rows, dtype=torch.int64, device=device)
    page_ids = torch.tensor(flat, dtype=torch.int64, device=device)
    return DecodeGroup(row_index, page_ids, max_pages, key_len, mask)


def _prefill_chunk(start: int, q_len: int, seq_len: int, pages: list[int], page_size: int,
                   device: torch.device) -> PrefillSpan:
    if q_len == seq_len:
        return PrefillSpan(start, start + q_len, None, seq_len, None)
    page_t = torch.tensor(_used_pages(pages, seq_len, page_size), dtype=torch.int64, device=device)
    key_pos = torch.arange(seq_len, device=device)[None, :]
    query_pos = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    return PrefillSpan(start, start + q_len, page_t, seq_len, key_pos <= query_pos)


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
        decode = _decode_group(d_rows, d_lens, d_tables, page_size, device) if d_rows else None
        return TorchAttentionMetadata(batch.slot_mapping, decode, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        layer_kv[0].view(-1, kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        layer_kv[1].view(-1, kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        if metadata.decode is not None and not metadata.prefills:
            return self._decode(q, layer_kv, metadata.decode, scale)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if metadata.decode is not None:
            rows = metadata.decode.rows
            out[rows] = self._decode(q[rows], layer_kv, metadata.decode, scale)
        for chunk in metadata.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, layer_kv, chunk, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, layer_kv: torch.Tensor, d: DecodeGroup, scale: float) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        page_size, kv_heads = layer_kv.shape[2], layer_kv.shape[3]
        # [batch, max_pages * page_size, kv_heads, head_dim] -> [batch, kv_heads, key_len, head_dim] (a view)
        keys = layer_kv[0].index_select(0, d.pages).view(batch, d.max_pages * page_size, kv_heads, head_dim)
        values = layer_kv[1].index_select(0, d.pages).view(batch, d.max_pages * page_size, kv_heads, head_dim)
        keys, values = keys[:, :d.key_len].transpose(1, 2), values[:, :d.key_len].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=d.mask, scale=scale,
                                             enable_gqa=True)  # [batch, num_heads, 1, head_dim]
        return out.reshape(batch, num_heads * head_dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                 chunk: PrefillSpan, scale: float) -> torch.Tensor:
        qc = q[chunk.start:chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        if chunk.pages is None:
            keys = k[chunk.start:chunk.end].transpose(0, 1)  # [kv_heads, q_len, head_dim]
            values = v[chunk.start:chunk.end].transpose(0, 1)
        else:
            kv_heads, head_dim = layer_kv.shape[3], layer_kv.shape[4]
            keys = layer_kv[0].index_select(0, chunk.pages).view(-1, kv_heads, head_dim)[:chunk.seq_len]
            values = layer_kv[1].index_select(0, chunk.pages).view(-1, kv_heads, head_dim)[:chunk.seq_len]
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        out = F.scaled_dot_product_attention(qc.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=chunk.mask, is_causal=chunk.pages is None, scale=scale,
                                             enable_gqa=True)  # [1, num_heads, q_len, head_dim]
        return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)
