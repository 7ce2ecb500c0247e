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
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch

STEP = 1
STOP = 2
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
    """``STEP`` or ``STOP``. Raises ValueError on anything else (a desynchronised group)."""
    op = int(message[0]) if message.numel() >= _HEADER else -1
    if op not in (STEP, STOP):
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
