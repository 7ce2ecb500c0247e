"""Perplexity of a causal LM on a token sequence: the quality gauge of the weight formats.

The reference text ships in ``eval_data/pride_and_prejudice_ch1.txt``: chapter 1 of Jane Austen's *Pride and
Prejudice* (1813), public domain, as in Project Gutenberg eBook #1342, typed out in plain ASCII (curly quotes
straightened). ``perplexity = exp(mean over t of -log p(token[t+1] | token[..t]))`` over the whole text in one
forward pass (no sliding window), so the result depends only on the weights and kernels.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.forward_batch import ForwardBatch
from engine.model.llama import LlamaForCausalLM

REFERENCE_TEXT_PATH = Path(__file__).with_name("eval_data") / "pride_and_prejudice_ch1.txt"


def reference_text() -> str:
    """The shipped public-domain text (about 5 KB)."""
    return REFERENCE_TEXT_PATH.read_text(encoding="utf-8")


def perplexity(model: LlamaForCausalLM, token_ids: list[int], page_size: int = 16) -> float:
    """Perplexity of ``token_ids`` (at least 2, at most the model's context) under ``model``.

    Runs one prefill over a private paged KV cache in the model's dtype (``[num_layers, 2, num_pages,
    page_size, num_kv_heads, head_dim]``); the model's own cache and engines are untouched.

    Raises:
        ValueError: fewer than 2 tokens or more than the model's context length.
    """
    cfg = model.config
    n = len(token_ids)
    if not 2 <= n <= cfg.max_position_embeddings:
        raise ValueError(f"need 2..{cfg.max_position_embeddings} tokens, got {n}")
    num_pages = -(-n // page_size)
    kv = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.dtype, device=model.device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    positions = torch.arange(n, dtype=torch.int64, device=model.device)
    batch = ForwardBatch(input_ids=ids, positions=positions, slot_mapping=positions, query_lens=[n],
                         seq_lens=[n], page_tables=[list(range(num_pages))], logits_indices=positions[:-1])
    with torch.inference_mode():
        logits = model.forward(batch, kv)  # [n - 1, vocab] float32
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean")
    return math.exp(float(nll))
