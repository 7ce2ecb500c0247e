"""Migration: a request whose children fail after its first token reached the client moves to another decode.

Dynamo's ``--migration-limit`` idea, on this project's wire (docs/architecture.md, "Migration"):

1. every child response carries the ids of its new tokens (``output_token_ids``); the merge keeps all the ids
   it forwarded to the client, in order (prefill's first token, then decode's);
2. a child failure that is not about the request itself (unreachable, a broken stream, an error a child
   reports: its KV transfer failed, its engine died; silence for ``request_idle_timeout_s``) after the first
   token, while the request has not ended,
   cancels the request's open children (a prefill still sending KV frees its pages) and starts a **direct
   decode** on another decode instance (``pick_decode``; every instance that failed this request excluded)
   with ``resume_token_ids`` = those ids: it prefills prompt + ids and streams only the tokens after them;
3. the merge goes on into the same client stream: the new child's ``num_output_tokens`` counts the resumed
   tokens; its ``cumulative_logprob`` counts them as 0.0, so the router adds the sum it had
   (``MigrationState.logprob_base``); its per-token logprobs are the new tokens' only;
4. at most ``migration_limit`` times per request; then (or with no decode instance left) the client gets the
   error. Greedy and seeded requests produce the text of an uninterrupted run (``engine.resume``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.router.fleet import Candidate, Target
from serving.router.pairing import NoInstance
from serving.router.ranks import decode_rank


@dataclass
class MigrationState:
    """One request's migration bookkeeping (router event loop thread).

    Attributes:
        token_ids: ids of every token forwarded to the client so far, in order.
        logprob_base: cumulative logprob of the tokens the current decode child was resumed with.
        num_migrations: migrations done.
        failed: instance ids that failed this request (never chosen again for it).
    """

    token_ids: list[int] = field(default_factory=list)
    logprob_base: float = 0.0
    num_migrations: int = 0
    failed: set[str] = field(default_factory=set)


def pick_decode(candidates: Sequence[Candidate], tokens_to_reserve: int) -> Target:
    """The decode instance a migrated request goes to: among those whose free pages hold
    ``tokens_to_reserve`` (or all, when none does), the one with the most free pages, then the shortest queue;
    on an instance with DP attention, its roomiest rank (``serving.router.ranks.decode_rank``).

    Raises:
        NoInstance: ``candidates`` is empty.
    """
    if not candidates:
        raise NoInstance("decode")
    fits = [c for c in candidates if c.fits(c.pages_for(tokens_to_reserve))]
    chosen = max(fits or candidates, key=lambda c: (c.free_pages, -c.queued_requests))
    return decode_rank(chosen, chosen.pages_for(tokens_to_reserve))
