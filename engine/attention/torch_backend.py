"""Paged attention in plain torch for the CPU (and as a reference on any device).

Per step, ``prepare`` sorts the batch into one *decode group* (every sequence with one new token, padded to the
longest KV length with a key mask) and a list of *prefill chunks* (a sequence with several new tokens), and
precomputes the flat KV slot indices each of them gathers. Per layer, ``forward`` writes the new K/V rows with
one ``index_copy_``, gathers each group's K/V with one index, and runs ``scaled_dot_product_attention`` with
``enable_gqa`` (kv head ``h // (num_heads // num_kv_heads)`` serves query head ``h``, as HF's ``repeat_kv``).
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
    """Sequences with one query token each.

    Attributes:
        rows: ``[B]`` int64 token rows of the queries in the batch, or the slice ``0:B`` when they lead the batch.
        gather: ``[B * max_len]`` int64 flat KV slots (padding points at slot 0 and is masked out).
        max_len: longest KV length in the group, in tokens.
        mask: ``[B, 1, 1, max_len]`` bool, True where a key is attended; ``None`` when all lengths are equal.
    """

    rows: torch.Tensor | slice
    gather: torch.Tensor
    max_len: int
    mask: torch.Tensor | None


@dataclass
class PrefillChunk:
    """One sequence's chunk of ``end - start`` query tokens (rows ``start:end`` of the batch).

    Attributes:
        gather: ``[seq_len]`` int64 flat KV slots of the whole sequence, or ``None`` when nothing is cached.
        mask: ``[q, seq_len]`` bool causal mask aligned bottom-right, or ``None`` when nothing is cached.
    """

    start: int
    end: int
    gather: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    """What ``TorchAttentionBackend.prepare`` computes once per step."""

    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillChunk] = field(default_factory=list)


def _padded_slots(tables: list[list[int]], lens: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """``[num_seqs, max(lens)]`` int64 flat KV slots; positions past a sequence's length point at page 0."""
    max_len = max(lens)
    max_pages = -(-max_len // page_size)
    padded = []
    for pages, n in zip(tables, lens):
        if len(pages) * page_size < n:
            raise ValueError(f"page table of {len(pages)} pages too short for seq_len={n} (page_size={page_size})")
        used = pages[:-(-n // page_size)]
        padded.append(used + [0] * (max_pages - len(used)))
    table = torch.tensor(padded, dtype=torch.int64, device=device)  # [num_seqs, max_pages]
    slots = table[:, :, None] * page_size + torch.arange(page_size, device=device)
    return slots.view(len(tables), -1)[:, :max_len]


def _decode_group(rows: list[int], lens: list[int], tables: list[list[int]], page_size: int,
                  device: torch.device) -> DecodeGroup:
    max_len = max(lens)
    gather = _padded_slots(tables, lens, page_size, device).reshape(-1)
    mask = None
    if min(lens) != max_len:
        lens_t = torch.tensor(lens, device=device)
        mask = (torch.arange(max_len, device=device)[None, :] < lens_t[:, None]).view(len(lens), 1, 1, max_len)
    leading = rows == list(range(len(rows)))
    row_index = slice(0, len(rows)) if leading else torch.tensor(rows, dtype=torch.int64, device=device)
    return DecodeGroup(row_index, gather, max_len, mask)


def _prefill_chunk(start: int, q_len: int, seq_len: int, pages: list[int], page_size: int,
                   device: torch.device) -> PrefillChunk:
    if q_len == seq_len:
        return PrefillChunk(start, start + q_len, None, None)
    gather = _padded_slots([pages], [seq_len], page_size, device)[0]
    cached = seq_len - q_len
    key_pos = torch.arange(seq_len, device=device)[None, :]
    query_pos = torch.arange(q_len, device=device)[:, None] + cached
    return PrefillChunk(start, start + q_len, gather, key_pos <= query_pos)


class TorchAttentionBackend(AttentionBackend):
    """CPU-friendly paged attention with SDPA; see the module docstring for the algorithm."""

    def prepare(self, batch: ForwardBatch, page_size: int) -> TorchAttentionMetadata:
        device = batch.slot_mapping.device
        d_rows: list[int] = []
        d_lens: list[int] = []
        d_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
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
        k_flat = layer_kv[0].view(-1, kv_heads, head_dim)  # [num_pages * page_size, kv_heads, head_dim]
        v_flat = layer_kv[1].view(-1, kv_heads, head_dim)
        k_flat.index_copy_(0, metadata.slot_mapping, k)
        v_flat.index_copy_(0, metadata.slot_mapping, v)
        if metadata.decode is not None and not metadata.prefills:
            return self._decode(q, k_flat, v_flat, metadata.decode, scale)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if metadata.decode is not None:
            rows = metadata.decode.rows
            out[rows] = self._decode(q[rows], k_flat, v_flat, metadata.decode, scale)
        for chunk in metadata.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_flat, v_flat, chunk, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, d: DecodeGroup,
                scale: float) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        kv_heads = k_flat.shape[1]
        keys = k_flat[d.gather].view(batch, d.max_len, kv_heads, head_dim).transpose(1, 2)
        values = v_flat[d.gather].view(batch, d.max_len, kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=d.mask, scale=scale,
                                             enable_gqa=True)  # [batch, num_heads, 1, head_dim]
        return out.reshape(batch, num_heads * head_dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        qc = q[chunk.start:chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        if chunk.gather is None:
            keys = k[chunk.start:chunk.end].transpose(0, 1)
            values = v[chunk.start:chunk.end].transpose(0, 1)
        else:
            keys = k_flat[chunk.gather].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            values = v_flat[chunk.gather].transpose(0, 1)
        out = F.scaled_dot_product_attention(qc.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=chunk.mask, is_causal=chunk.gather is None, scale=scale,
                                             enable_gqa=True)  # [1, num_heads, q_len, head_dim]
        return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)
