"""Which DP-attention rank of a paired instance runs a request.

An instance with DP attention (``enable_dp_attention``, docs/parallelism.md) runs each request on one of its
ranks, with that rank's own scheduler queue and KV pool. Its load report lists each rank's free pages and
queued prompt tokens (``InstanceLoad.rank_free_pages``, ``rank_queued_prompt_tokens``), which the fleet turns
into ``Candidate.ranks`` (with this router's own assignments since the report). Once a policy has chosen the
instance, these functions choose the rank, and the ``Target`` they return carries it (``Target.dp_rank``): the
child request names it (the ``dp_rank`` input), the instance runs the request there, and on a decode the
prompt's KV lands in that rank's pool (its reservation's page ids are that rank's). An instance of one pool
(no ranks) gets its target unchanged, so a mixed fleet (DP attention on one side only) pairs as any other.

- prefill: the least work before this prompt's first token, ``queued_prompt_tokens - hit tokens`` of the rank
  (SGLang's router balances DP ranks by their queues in the same way);
- decode: among the ranks whose free pages hold the request (hit pages shared), the most
  ``free_pages + hit pages``, then the fewest queued prompt tokens.

``hit_pages(rank)`` is the cache-aware policy's belief of the prompt's leading pages that rank's prefix cache
holds (``PrefixIndex``, keyed per instance and rank); 0 for the load-aware ones. Ties go round the ranks from
``start`` (a policy's counter), so an idle instance still spreads requests over its ranks. Pure functions, on
the router's event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from serving.router.fleet import Candidate, Target

#: ``hit_pages(rank)``: prompt pages that rank is believed to hold in its prefix cache
HitPages = Callable[[int], int]


def _no_hit(rank: int) -> int:
    return 0


def _rotated(n: int, start: int) -> list[int]:
    return [(start + i) % n for i in range(n)]


def prefill_rank(candidate: Candidate, hit_pages: HitPages = _no_hit, start: int = 0) -> Target:
    """``candidate``'s target on the rank with the least queued prompt tokens less its hit tokens (ties:
    round from ``start``); its target unchanged when it has no ranks."""
    ranks = candidate.ranks
    if not ranks:
        return candidate.target
    rank = min(_rotated(len(ranks), start),
               key=lambda r: ranks[r].queued_prompt_tokens - hit_pages(r) * candidate.page_size)
    return replace(candidate.target, dp_rank=rank)


def decode_rank(candidate: Candidate, num_pages: int, hit_pages: HitPages = _no_hit,
                start: int = 0) -> Target:
    """``candidate``'s target on the rank, among those whose free pages hold ``num_pages`` less the hit pages
    (all ranks when none does), with the most free pages plus hit pages, then the fewest queued prompt tokens
    (ties: round from ``start``); its target unchanged when it has no ranks."""
    ranks = candidate.ranks
    if not ranks:
        return candidate.target
    order = _rotated(len(ranks), start)
    fits = [r for r in order if ranks[r].free_pages >= num_pages - hit_pages(r)]
    rank = max(fits or order,
               key=lambda r: (ranks[r].free_pages + hit_pages(r), -ranks[r].queued_prompt_tokens))
    return replace(candidate.target, dp_rank=rank)

