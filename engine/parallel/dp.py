"""The token exchanges of DP attention (docs/parallelism.md, "DP attention"): each rank runs attention on its
own requests' tokens; a layer that is split over the ranks by columns (a dense MLP, the LM head) needs every
rank's tokens, and each rank keeps only its own rows of the result.

Both exchanges are one ``Communicator.all_reduce`` of a ``[T, hidden]`` tensor (``T``: every rank's tokens)
that is zero outside the contributing rank's rows, so they are exact (adding zeros changes no bit) and every
rank ends with bit-identical values. Every rank makes the same calls with the same ``DPShares``, an idle rank
(no tokens) included; on the caller's thread (the engine thread; a rank process's main thread).
"""

from __future__ import annotations

import torch

from engine.forward_batch import DPShares
from engine.parallel.communicator import Communicator


def gather_rows(comm: Communicator, x: torch.Tensor, counts: tuple[int, ...], rank: int) -> torch.Tensor:
    """Every rank's rows, ranks in order.

    Args:
        comm: the rank group's communicator.
        x: ``[counts[rank], H]`` this rank's rows, model dtype.
        counts: rows of every rank (the same tuple on every rank).
        rank: this rank.
    Returns:
        ``[sum(counts), H]``, same dtype; ``x``'s rows at this rank's place.
    Raises:
        CollectiveError: the all-reduce failed (a rank died or timed out).
    """
    total = sum(counts)
    if total == 0:   # every rank knows it: none calls the collective
        return x
    full = x.new_zeros(total, x.shape[1])
    start = sum(counts[:rank])
    full[start:start + counts[rank]] = x
    return comm.all_reduce(full)


def gather_tokens(comm: Communicator, x: torch.Tensor, dp: DPShares) -> torch.Tensor:
    """``x`` ``[dp.token_counts[dp.rank], H]`` -> every rank's tokens ``[dp.num_tokens, H]``
    (``gather_rows``)."""
    return gather_rows(comm, x, dp.token_counts, dp.rank)


def keep_own_rows(comm: Communicator, partial: torch.Tensor, dp: DPShares) -> torch.Tensor:
    """Sum a column-split layer's partial outputs over the ranks and keep this rank's tokens.

    Args:
        partial: ``[dp.num_tokens, H]`` this rank's partial sums for every rank's tokens (overwritten).
    Returns:
        ``[dp.token_counts[dp.rank], H]``.
    Raises:
        CollectiveError: as ``gather_rows``.
    """
    if dp.num_tokens == 0:
        return partial
    rows = dp.token_rows
    return comm.all_reduce(partial.contiguous())[rows.start:rows.stop]
