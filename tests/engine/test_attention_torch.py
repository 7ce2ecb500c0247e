"""The torch paged attention backend equals dense causal attention computed naively, for every batch shape the
scheduler produces: one-chunk prefill, prefill split in chunks across page boundaries, ragged decode batches,
mixed prefill + decode steps, GQA and MHA, page tables in arbitrary (non-contiguous) order.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend, _bucket_bounds
from engine.forward_batch import ForwardBatch

PAGE_SIZE = 4
NUM_PAGES = 64
HEAD_DIM = 8


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full causal attention of one sequence: q/k/v ``[seq, heads, head_dim]`` -> ``[seq, heads *
    head_dim]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).reshape(q.shape[0], -1).float()


class _Sequence:
    """A random sequence of ``length`` tokens with its full q/k/v and a shuffled page table."""

    def __init__(self, length: int, heads: int, kv_heads: int, pages: list[int],
                 gen: torch.Generator) -> None:
        self.q = torch.randn(length, heads, HEAD_DIM, generator=gen)
        self.k = torch.randn(length, kv_heads, HEAD_DIM, generator=gen)
        self.v = torch.randn(length, kv_heads, HEAD_DIM, generator=gen)
        self.pages = pages
        self.expected = _dense_reference(self.q, self.k, self.v)

    def slots(self, start: int, end: int) -> list[int]:
        return [self.pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(start, end)]


def _make(lengths: list[int], heads: int = 6, kv_heads: int = 2, seed: int = 0,
          in_order: bool = False) -> list[_Sequence]:
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_PAGES, generator=gen).tolist()  # non-contiguous, unordered pages
    if in_order:  # each sequence's pages are consecutive ids, as a fresh allocator hands them out
        order = list(range(NUM_PAGES))
    seqs, used = [], 0
    for n in lengths:
        count = -(-n // PAGE_SIZE)
        seqs.append(_Sequence(n, heads, kv_heads, order[used:used + count], gen))
        used += count
    return seqs


def _batch(work: list[tuple[_Sequence, int, int]]) -> ForwardBatch:
    """The ``ForwardBatch`` of a step where sequence ``s`` contributes its tokens ``start:end``."""
    num_tokens = sum(b - a for _, a, b in work)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        slot_mapping=torch.tensor([slot for s, a, b in work for slot in s.slots(a, b)]),
        query_lens=[b - a for _, a, b in work], seq_lens=[b for _, _, b in work],
        page_tables=[s.pages for s, _, _ in work], logits_indices=torch.zeros(0, dtype=torch.int64))


def _step(backend: TorchAttentionBackend, kv: torch.Tensor, work: list[tuple[_Sequence, int,
                                                                             int]]) -> torch.Tensor:
    """Run one step where sequence ``s`` contributes its tokens ``start:end``; returns the attention
    output."""
    q = torch.cat([s.q[a:b] for s, a, b in work])
    k = torch.cat([s.k[a:b] for s, a, b in work])
    v = torch.cat([s.v[a:b] for s, a, b in work])
    meta = backend.prepare(_batch(work), PAGE_SIZE)
    return backend.forward(q, k, v, kv, meta, HEAD_DIM ** -0.5)


def _kv(kv_heads: int) -> torch.Tensor:
    return torch.zeros(2, NUM_PAGES, PAGE_SIZE, kv_heads,
                       HEAD_DIM)  # one layer's [2, pages, page_size, kvh, hd]


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_single_chunk_prefill_matches_dense(heads: int, kv_heads: int) -> None:
    """A whole prompt in one chunk (batch of three ragged prompts) equals dense causal attention."""
    seqs = _make([13, 4, 9], heads, kv_heads)
    out = _step(TorchAttentionBackend(), _kv(kv_heads), [(s, 0, s.q.shape[0]) for s in seqs])
    torch.testing.assert_close(out, torch.cat([s.expected for s in seqs]), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_across_page_boundaries_matches_dense() -> None:
    """Feeding a prompt as chunks 3 + 6 + 1 + 7 (boundaries inside pages) gives the rows of one-shot
    attention."""
    (seq,) = _make([17])
    backend, kv = TorchAttentionBackend(), _kv(2)
    bounds = [0, 3, 9, 10, 17]
    outs = [_step(backend, kv, [(seq, a, b)]) for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat(outs), seq.expected, atol=1e-5, rtol=1e-5)


def test_ragged_decode_batch_matches_dense() -> None:
    """After prefill, decoding the last token of sequences of lengths 1, 4, 5, 12 in one batch matches
    dense."""
    seqs = _make([1, 4, 5, 12])
    backend, kv = TorchAttentionBackend(), _kv(2)
    _step(backend, kv, [(s, 0, s.q.shape[0] - 1) for s in seqs if s.q.shape[0] > 1])
    out = _step(backend, kv, [(s, s.q.shape[0] - 1, s.q.shape[0]) for s in seqs])
    torch.testing.assert_close(out, torch.stack([s.expected[-1] for s in seqs]), atol=1e-5, rtol=1e-5)


def test_equal_length_decode_batch_matches_dense() -> None:
    """Decode of equal-length sequences (the unmasked fast path) matches dense."""
    seqs = _make([8, 8, 8])
    backend, kv = TorchAttentionBackend(), _kv(2)
    _step(backend, kv, [(s, 0, 7) for s in seqs])
    out = _step(backend, kv, [(s, 7, 8) for s in seqs])
    torch.testing.assert_close(out, torch.stack([s.expected[-1] for s in seqs]), atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_step_matches_dense() -> None:
    """One step holding a decode, a continued chunk, a fresh prompt and another decode (in that order)
    matches."""
    a, b, c, d = _make([6, 11, 5, 9])
    backend, kv = TorchAttentionBackend(), _kv(2)
    _step(backend, kv, [(a, 0, 5), (b, 0, 4), (d, 0, 8)])
    out = _step(backend, kv, [(a, 5, 6), (b, 4, 11), (c, 0, 5), (d, 8, 9)])
    expected = torch.cat([a.expected[5:], b.expected[4:], c.expected, d.expected[8:]])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kv_written_at_slot_mapping() -> None:
    """After a step, K and V of token t sit at page ``pages[t // page_size]``, offset ``t % page_size``."""
    (seq,) = _make([10])
    kv = _kv(2)
    _step(TorchAttentionBackend(), kv, [(seq, 0, 10)])
    for t in range(10):
        page, off = seq.pages[t // PAGE_SIZE], t % PAGE_SIZE
        assert torch.equal(kv[0, page, off], seq.k[t]) and torch.equal(kv[1, page, off], seq.v[t])


def test_short_page_table_is_rejected() -> None:
    """A page table too short for its sequence length raises ValueError in prepare (not a silent wrong
    read)."""
    batch = ForwardBatch(torch.zeros(1, dtype=torch.int64), torch.tensor([8]), torch.tensor([0]), [1], [9],
                         [[0, 1]],
                         torch.tensor([0]))
    with pytest.raises(ValueError, match="too short"):
        TorchAttentionBackend().prepare(batch, PAGE_SIZE)


def test_decode_buckets_cut_far_apart_lengths_only() -> None:
    """Equal page counts stay one bucket; a cluster of short and a cluster of long sequences split in two."""
    assert _bucket_bounds([3, 3, 3]) == [3]
    assert _bucket_bounds([1, 1, 1, 30, 31, 32]) == [3, 6]


def test_bucketed_ragged_decode_matches_dense() -> None:
    """A decode batch of interleaved short and long sequences runs as several buckets (rows out of batch
    order) and still matches dense for every row."""
    lengths = [3, 40, 2, 37, 5, 44]
    seqs = _make(lengths)
    backend, kv = TorchAttentionBackend(), _kv(2)
    _step(backend, kv, [(s, 0, s.q.shape[0] - 1) for s in seqs])
    work = [(s, s.q.shape[0] - 1, s.q.shape[0]) for s in seqs]
    assert len(backend.prepare(_batch(work), PAGE_SIZE).decodes) > 1
    out = _step(backend, kv, work)
    torch.testing.assert_close(out, torch.stack([s.expected[-1] for s in seqs]), atol=1e-5, rtol=1e-5)


def test_consecutive_pages_read_as_pool_slice_match_dense() -> None:
    """A sequence on consecutive page ids is read as a slice of the pool (no gather), for batch-1 decode and
    for a continued prefill chunk, and matches dense."""
    (seq,) = _make([19], in_order=True)
    backend, kv = TorchAttentionBackend(), _kv(2)
    first = _step(backend, kv, [(seq, 0, 9)])
    meta = backend.prepare(_batch([(seq, 9, 18)]), PAGE_SIZE)
    assert meta.prefills[0].kv is not None and meta.prefills[0].kv.first_page == seq.pages[0]
    chunk = _step(backend, kv, [(seq, 9, 18)])
    decode_meta = backend.prepare(_batch([(seq, 18, 19)]), PAGE_SIZE)
    assert decode_meta.decodes[0].kv.first_page == seq.pages[0]
    last = _step(backend, kv, [(seq, 18, 19)])
    torch.testing.assert_close(torch.cat([first, chunk, last]), seq.expected, atol=1e-5, rtol=1e-5)
