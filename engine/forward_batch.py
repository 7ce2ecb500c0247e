"""Inputs of one forward pass over a continuous batch: the seam between the scheduler and the model.

The model runner builds one ``ForwardBatch`` per engine step from the scheduled sequences (prefill chunks and
decode tokens mixed in one batch, sequences in scheduling order); the model and its attention backend read it
and nothing else (no hidden globals). Token ``i`` of the batch belongs to the sequence whose cumulative
``query_lens`` range covers ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DPShares:
    """Where one rank's tokens sit among every rank's, in a step of a DP-attention engine (each rank runs
    attention on its own requests; docs/parallelism.md, "DP attention").

    Attributes:
        rank: this rank.
        token_counts: ``[dp_size]`` tokens of each rank's batch this step (0: an idle rank).
        logits_counts: ``[dp_size]`` logits rows of each rank's batch this step.
    """

    rank: int
    token_counts: tuple[int, ...]
    logits_counts: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens of every rank together (the rows a gathered ``[T, hidden]`` tensor has)."""
        return sum(self.token_counts)

    @property
    def token_rows(self) -> range:
        """This rank's rows in the gathered tokens (ranks in order)."""
        start = sum(self.token_counts[:self.rank])
        return range(start, start + self.token_counts[self.rank])

    @property
    def logits_rows(self) -> range:
        """This rank's rows in the gathered logits rows (ranks in order)."""
        start = sum(self.logits_counts[:self.rank])
        return range(start, start + self.logits_counts[self.rank])


@dataclass
class ForwardBatch:
    """One step's inputs.

    Attributes:
        input_ids: ``[num_tokens]`` int64, the new tokens of every sequence, concatenated.
        positions: ``[num_tokens]`` int64, absolute position of each token in its sequence.
        slot_mapping: ``[num_tokens]`` int64, flat KV slot (``page_id * page_size + offset``) where each
            token's K and V are written before attention reads them.
        query_lens: ``[num_seqs]`` new tokens per sequence in this step (sum is ``num_tokens``).
        seq_lens: ``[num_seqs]`` KV length of each sequence after this step (cached + new tokens).
        page_tables: ``[num_seqs][ceil(seq_len / page_size)]`` page ids holding each sequence's KV, in order.
        logits_indices: ``[num_logits]`` int64, rows of the final hidden states projected to logits (the last
            token of each sequence that samples this step; a non-final prefill chunk samples nothing).
        dp: in a DP-attention engine, this batch's place among every rank's (``DPShares``); None otherwise.
            A DP rank's batch may be empty (no sequence: an idle rank still takes part in the collectives).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    page_tables: list[list[int]]
    logits_indices: torch.Tensor
    dp: DPShares | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.query_lens) or len(self.page_tables) != len(self.query_lens):
            raise ValueError("query_lens, seq_lens and page_tables must have one entry per sequence")
        if sum(self.query_lens) != self.num_tokens:
            raise ValueError(f"sum(query_lens)={sum(self.query_lens)} != num_tokens={self.num_tokens}")
        for q, s in zip(self.query_lens, self.seq_lens):
            if q <= 0 or q > s:
                raise ValueError(f"need 0 < query_len <= seq_len, got query_len={q} seq_len={s}")
