"""The flashinfer backend module imports on any machine, CPU selection never picks it, and on CUDA with
flashinfer
it matches the torch backend (mixed prefill/decode steps, GQA, shuffled pages) within bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, select_backend
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available
from engine.forward_batch import ForwardBatch


def test_cpu_selects_torch_backend() -> None:
    """On the CPU (and for fp32 anywhere) the torch backend is chosen; importing flashinfer_backend is
    safe."""
    assert isinstance(select_backend("cpu"), TorchAttentionBackend)
    assert isinstance(select_backend("cpu", torch.bfloat16), TorchAttentionBackend)


def _batch(device: str, page_size: int) -> tuple[ForwardBatch, list[int]]:
    """Step: a decode at length 9, a chunk 5..12 of a 12-token sequence, a fresh 3-token prompt."""
    tables = [[7, 2, 9], [4, 0, 11], [5]]
    query, seq = [1, 7, 3], [9, 12, 3]
    slots, positions = [], []
    for q_len, s_len, pages in zip(query, seq, tables):
        for t in range(s_len - q_len, s_len):
            positions.append(t)
            slots.append(pages[t // page_size] * page_size + t % page_size)
    n = sum(query)
    return ForwardBatch(torch.zeros(n, dtype=torch.int64, device=device), torch.tensor(positions,
                                                                                       device=device),
                        torch.tensor(slots, device=device), query, seq, tables,
                        torch.zeros(0, dtype=torch.int64, device=device)), slots


@pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")
def test_flashinfer_matches_torch_backend() -> None:
    """Same K/V history and step: flashinfer's output equals the torch backend's (bf16, atol 2e-2)."""
    page_size, heads, kv_heads, head_dim, dev = 4, 8, 2, 64, "cuda"
    batch, _ = _batch(dev, page_size)
    gen = torch.Generator(device=dev).manual_seed(0)
    history = torch.randn(2, 12, page_size, kv_heads, head_dim, generator=gen, device=dev,
                          dtype=torch.bfloat16)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fi = FlashInferAttentionBackend(torch.device(dev))
    fi.bind(heads, kv_heads, head_dim, torch.bfloat16)
    ref = TorchAttentionBackend()
    kv_fi, kv_ref = history.clone(), history.clone()
    out_fi = fi.forward(q, k, v, kv_fi, fi.prepare(batch, page_size), head_dim ** -0.5)
    out_ref = ref.forward(q, k, v, kv_ref, ref.prepare(batch, page_size), head_dim ** -0.5)
    assert torch.equal(kv_fi, kv_ref)
    torch.testing.assert_close(out_fi.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
