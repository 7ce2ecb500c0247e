"""The step broadcast's message: what every rank's forward needs of one ``ForwardBatch``, as one int64 tensor.

Rank 0 schedules; each step it sends this message (``Communicator.broadcast_step``) and every rank runs its
shard of the same forward. Layout (int64, in order):

```
[op, T, S, L, P,                     op: STEP or STOP; T tokens, S sequences, L logits rows, P page ids
 input_ids[T], positions[T], slot_mapping[T],
 query_lens[S], seq_lens[S], page_table_lens[S],
 page_ids[P] (every sequence's page table, concatenated), logits_indices[L]]
```

A ``STOP`` message is the header alone: the rank process exits cleanly.

A DP-attention engine (each rank its own requests, docs/parallelism.md) sends every rank's batch in one
message, so that each rank knows its own batch and how many tokens and logits rows every other rank has:

```
[DP_STEP, N, len_0 .. len_{N-1}, step_0 .. step_{N-1}]     step_r: rank r's batch as a STEP message above
```
"""

from __future__ import annotations

import torch

from engine.forward_batch import DPShares, ForwardBatch

STEP = 1
STOP = 2
DP_STEP = 3
_HEADER = 5


def encode_step(batch: ForwardBatch) -> torch.Tensor:
    """``batch`` as a ``[n]`` int64 CPU tensor (the layout above); called by rank 0 on its engine thread."""
    lens = [len(p) for p in batch.page_tables]
    head = [STEP, batch.num_tokens, batch.num_seqs, int(batch.logits_indices.shape[0]), sum(lens)]
    ints = torch.tensor(head + batch.query_lens + batch.seq_lens + lens +
                        [p for table in batch.page_tables for p in table], dtype=torch.int64)
    parts = [ints[:_HEADER], batch.input_ids.cpu(), batch.positions.cpu(), batch.slot_mapping.cpu(),
             ints[_HEADER:], batch.logits_indices.cpu()]
    return torch.cat(parts)


def encode_stop() -> torch.Tensor:
    """The message that ends every rank process's loop."""
    return torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64)


def message_op(message: torch.Tensor) -> int:
    """``STEP``, ``DP_STEP`` or ``STOP``. Raises ValueError on anything else (a desynchronised group)."""
    op = int(message[0]) if message.numel() >= 2 else -1
    if op not in (STEP, STOP, DP_STEP) or (op != DP_STEP and message.numel() < _HEADER):
        raise ValueError(f"not a step message (op {op}, {message.numel()} ints)")
    return op


def decode_step(message: torch.Tensor, device: torch.device) -> ForwardBatch:
    """The ``ForwardBatch`` of a ``STEP`` message, its index tensors on ``device``.

    Raises:
        ValueError: the message is not a well-formed ``STEP`` (wrong op or length).
    """
    if message_op(message) != STEP:
        raise ValueError("decode_step needs a STEP message")
    t, s, num_logits, p = (int(v) for v in message[1:_HEADER])
    if message.numel() != _HEADER + 3 * t + 3 * s + p + num_logits:
        raise ValueError(f"step message of {message.numel()} ints does not match its header "
                         f"{(t, s, num_logits, p)}")
    values = message[_HEADER:].split([t, t, t, s, s, s, p, num_logits])
    input_ids, positions, slots, query_lens, seq_lens, table_lens, pages, logits_indices = values
    flat_pages = pages.tolist()
    tables, at = [], 0
    for n in table_lens.tolist():
        tables.append(flat_pages[at:at + n])
        at += n
    return ForwardBatch(input_ids=input_ids.to(device), positions=positions.to(device),
                        slot_mapping=slots.to(device), query_lens=query_lens.tolist(),
                        seq_lens=seq_lens.tolist(), page_tables=tables,
                        logits_indices=logits_indices.to(device))


def encode_dp_step(batches: list[ForwardBatch]) -> torch.Tensor:
    """Every DP rank's batch (``batches[r]``: rank r's, possibly empty) as one ``[n]`` int64 CPU tensor (the
    ``DP_STEP`` layout above); called by rank 0 on its engine thread."""
    parts = [encode_step(b) for b in batches]
    head = torch.tensor([DP_STEP, len(parts), *(p.numel() for p in parts)], dtype=torch.int64)
    return torch.cat([head, *parts])


def decode_dp_step(message: torch.Tensor, rank: int, device: torch.device) -> ForwardBatch:
    """Rank ``rank``'s ``ForwardBatch`` of a ``DP_STEP`` message, its ``dp`` shares filled from every rank's
    header, its index tensors on ``device``.

    Raises:
        ValueError: not a well-formed ``DP_STEP`` message, or ``rank`` is not one of its ranks.
    """
    if message_op(message) != DP_STEP:
        raise ValueError("decode_dp_step needs a DP_STEP message")
    n = int(message[1])
    lens = [int(v) for v in message[2:2 + n]]
    if not 0 <= rank < n or message.numel() != 2 + n + sum(lens):
        raise ValueError(f"DP step message of {message.numel()} ints, {n} ranks, does not fit rank {rank}")
    parts = message[2 + n:].split(lens)
    tokens = tuple(int(p[1]) for p in parts)
    logits = tuple(int(p[3]) for p in parts)
    batch = decode_step(parts[rank], device)
    batch.dp = DPShares(rank, tokens, logits)
    return batch
