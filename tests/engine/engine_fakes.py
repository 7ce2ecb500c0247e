"""A tiny deterministic model + tokenizer for engine tests (tests only; no weights).

The fake model writes ``token_id + 1`` into the K cache of layer 0 (all heads and dims) at each token's slot,
then, for every sequence that samples, reads its whole KV back through its page table and predicts
``next = sum(tokens) % VOCAB``. A wrong slot mapping, page table or KV copy therefore changes the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch

VOCAB = 100
EOS = 0


@dataclass(frozen=True)
class FakeModelConfig:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 2
    vocab_size: int = VOCAB
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = (EOS,)
    kv_layout_kind: str = "mha"   # ModelConfig.kv_layout_kind: K and V planes


class FakeTokenizer:
    """Token ``i`` decodes to ``"<i>"``; EOS is special (skipped)."""

    eos_token_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.replace(">", " ").replace("<", " ").split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (i == EOS and skip_special_tokens) else f"<{i}>" for i in ids)


class FakeModel:
    def __init__(self) -> None:
        self.num_forwards = 0
        self.num_tokens_seen: list[int] = []

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        self.num_forwards += 1
        self.num_tokens_seen.append(batch.num_tokens)
        ps = kv_cache.shape[3]
        k0 = kv_cache[0, 0]  # [num_pages, page_size, heads, dim], strided (page-major pool)
        slots = batch.slot_mapping
        k0[slots // ps, slots % ps] = (batch.input_ids + 1).to(kv_cache.dtype)[:, None, None]
        rows = []
        ends = torch.cumsum(torch.tensor(batch.query_lens), 0) - 1
        for i, (seq_len, pages) in enumerate(zip(batch.seq_lens, batch.page_tables)):
            if int(ends[i]) not in batch.logits_indices.tolist():
                continue
            seq_pages = [pages[t // ps] for t in range(seq_len)]
            total = int((k0[seq_pages, [t % ps for t in range(seq_len)], 0, 0] - 1).sum().item())
            row = torch.zeros(VOCAB)
            row[total % VOCAB] = 10.0
            rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


@dataclass
class FakeLoaded:
    model: FakeModel = field(default_factory=FakeModel)
    config: FakeModelConfig = field(default_factory=FakeModelConfig)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates greedily (ignoring EOS)."""
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = sum(toks) % VOCAB
        toks.append(nxt)
        out.append(nxt)
    return out


def run_all(engine, max_steps=500):
    """Step ``engine`` until it has nothing left (at most ``max_steps``); its outputs by request id, in
    order."""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs):
    """The generated token ids of one request's outputs, in order."""
    return [t for o in outs for t in o.new_token_ids]
