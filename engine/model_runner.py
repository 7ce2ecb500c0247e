"""Turns a scheduled step into a ``ForwardBatch``, runs the model on it and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.forward_batch import ForwardBatch
from engine.sampler import Sampler, TokenHistory, TopLogprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, pages_for_tokens
from engine.structured.matcher import fill_masks


class CausalLM(Protocol):
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the batch's K/V into ``kv_cache`` and return ``[num_logits, vocab_size]`` float32 logits."""
        ...


class DataParallelLM(Protocol):
    def forward_ranks(self, batches: list[ForwardBatch], kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step of a DP-attention instance: ``batches[r]`` is rank r's own batch (possibly empty),
        ``kv_cache`` rank 0's pool. Returns ``[sum of every batch's num_logits, vocab_size]`` float32 logits,
        rank 0's rows first, each rank's in its batch's order."""
        ...


@dataclass(frozen=True)
class SampledToken:
    """The token a sequence sampled this step, its raw-distribution logprob and (when the request asked for
    logprobs) its rank and the top alternatives."""

    seq: Sequence
    token_id: int
    logprob: float
    top: TopLogprobs | None = None


_NO_HISTORY = TokenHistory((), ())


class ModelRunner:
    """Runs one forward per step over the engine's KV cache; stateless between steps.

    Args:
        model: the causal LM (``engine.model``'s ``LlamaForCausalLM`` or any ``CausalLM``).
        kv_cache: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``, written by the model.
        device: where the batch's index tensors go (the model's device).
        dp_size: DP-attention ranks (``model`` then is a ``DataParallelLM``: each step gets one batch per
            rank, from the sequences whose ``dp_rank`` it is); 1: one batch.
    """

    def __init__(self, model: CausalLM | DataParallelLM, kv_cache: torch.Tensor, device: torch.device | str,
                 eos_token_ids: frozenset[int] = frozenset(), dp_size: int = 1) -> None:
        self.model = model
        self.dp_size = dp_size
        self.kv_cache = kv_cache
        self.page_size = int(kv_cache.shape[3])
        self.device = torch.device(device)
        self.sampler = Sampler(sorted(eos_token_ids))

    def run(self, scheduled: list[ScheduledSeq]) -> list[SampledToken]:
        """Compute the scheduled tokens' KV; sample for every sequence whose known tokens are all computed.

        Does not advance ``num_computed_tokens`` (the engine does, after the step).

        Returns:
            One ``SampledToken`` per sampling sequence, in scheduling order (a non-final prefill chunk samples
            nothing).
        """
        with torch.inference_mode():
            logits, samplers = self._forward(scheduled)
            if not samplers:
                return []
            histories = [s.history if s.params.processes_logits else _NO_HISTORY for s in samplers]
            masks = fill_masks([s.grammar for s in samplers], int(logits.shape[-1]))
            result = self.sampler(logits, [s.params for s in samplers], [s.generator for s in samplers],
                                  histories, masks)
        return [SampledToken(s, t, lp, top)
                for s, t, lp, top in zip(samplers, result.token_ids, result.logprobs, result.top)]

    def _forward(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence]]:
        """The step's logits and the sequences they sample for, row by row (DP: rank by rank)."""
        if self.dp_size == 1:
            batch, samplers = self.build_batch(scheduled)
            return self.model.forward(batch, self.kv_cache), samplers   # type: ignore[union-attr]
        per_rank: list[list[ScheduledSeq]] = [[] for _ in range(self.dp_size)]
        for item in scheduled:
            per_rank[item.seq.dp_rank].append(item)
        built = [self.build_batch(items) for items in per_rank]
        logits = self.model.forward_ranks([b for b, _ in built], self.kv_cache)   # type: ignore[union-attr]
        return logits, [seq for _, seqs in built for seq in seqs]

    def build_batch(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardBatch, list[Sequence]]:
        """The ``ForwardBatch`` of a step, and the sequences that sample (one logits row each, in order)."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        page_tables: list[list[int]] = []
        logits_indices: list[int] = []
        samplers: list[Sequence] = []
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            pages = seq.page_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend([pages[t // ps] * ps + t % ps for t in range(start, end)])
            query_lens.append(n)
            seq_lens.append(end)
            page_tables.append(pages[:pages_for_tokens(end, ps)])
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                samplers.append(seq)
        batch = ForwardBatch(
            input_ids=self._tensor(input_ids), positions=self._tensor(positions),
            slot_mapping=self._tensor(slots), query_lens=query_lens, seq_lens=seq_lens,
            page_tables=page_tables, logits_indices=self._tensor(logits_indices),
        )
        return batch, samplers

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
