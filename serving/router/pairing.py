"""Pairing policies: which prefill and which decode instance serve one request.

``LoadAwarePairing``: the prefill with the least queued prompt tokens (the work ahead of the new prompt, so
the least TTFT), and the decode with the most free KV pages among those that can hold prompt + max_tokens
right now (decode reserves that much up front; one that cannot must queue the request). Ties go round robin,
so an idle fleet still spreads requests. ``CacheAwarePairing`` (the default, ``RouterConfig.policy``) is load
aware with credit for the prefix each instance is likely to hold in its prefix cache (``PrefixIndex``: the
page keys of the prompts this router sent there), so a conversation's turns and prompts sharing a system
prompt land where their KV already is. ``RoundRobinPairing`` cycles through the healthy instances of each
role. Each may send a prompt shorter than ``direct_decode_max_tokens`` to a decode instance alone (it prefills
the prompt itself: no transfer, no prefill queue), as llm-d and Dynamo do for short prompts. On an instance
with DP attention each then chooses the rank too (``serving.router.ranks``: the least-loaded rank by its
reported load; the cache-aware policy credits each rank with the prefix it likely holds), and the pair's
targets carry it (``Target.dp_rank``).

Policies are pure: they see ``Candidate``s (healthy instances with their load) and a ``Demand``, and run on
the router's event loop thread.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.prefix_cache import PageHash, page_hashes, shareable_pages
from serving.router.fleet import Candidate, Target
from serving.router.ranks import decode_rank, prefill_rank


@dataclass(frozen=True)
class Demand:
    """What one request needs: ``prompt_tokens`` (after the chat template) and ``max_tokens``; ``token_ids``,
    the prompt's token ids when the router tokenized it (empty when it only estimated the count)."""

    prompt_tokens: int
    max_tokens: int
    token_ids: tuple[int, ...] = ()

    def cacheable_page_keys(self, page_size: int) -> list[PageHash]:
        """Keys of the prompt's pages an engine's prefix cache can share (``engine.prefix_cache`` keys of its
        ``shareable_pages``: the last prompt token is always computed)."""
        if not self.token_ids or page_size <= 0:
            return []
        usable = shareable_pages(len(self.token_ids), page_size) * page_size
        return page_hashes(self.token_ids[:usable], page_size, [])

    @property
    def tokens_to_reserve(self) -> int:
        """Tokens decode reserves pages for (the last sampled token's KV is never written)."""
        return self.prompt_tokens + self.max_tokens - 1


@dataclass(frozen=True)
class Pair:
    """The instances of one attempt, each with its DP rank where it has ranks; ``prefill`` None: direct decode
    (decode prefills the prompt itself)."""

    prefill: Target | None
    decode: Target


class NoInstance(Exception):
    """No healthy instance of ``role`` can take the request.

    Attributes:
        role: ``"prefill"`` or ``"decode"``.
    """

    def __init__(self, role: str, detail: str = "") -> None:
        super().__init__(f"no healthy {role} instance in the fleet{': ' + detail if detail else ''}")
        self.role = role


class PairingPolicy(Protocol):
    """Chooses a ``Pair``; raises ``NoInstance`` when a needed role has no candidate. Event loop thread."""

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair: ...


class _Rotation:
    """Round-robin tie breaking: each call starts one position further (``step``: the next start, for the
    DP ranks of ``serving.router.ranks``)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def step(self) -> int:
        return next(self._counter)

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        start = self.step() % len(candidates)
        return [*candidates[start:], *candidates[:start]]


class LoadAwarePairing:
    def __init__(self, direct_decode_max_tokens: int = 0) -> None:
        self._direct_max = direct_decode_max_tokens
        self._prefill_rotation = _Rotation()
        self._decode_rotation = _Rotation()
        self._prefill_ranks = _Rotation()
        self._decode_ranks = _Rotation()

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair:
        decode = self._decode(decodes, demand)
        need = decode.pages_for(demand.tokens_to_reserve)
        decode_target = decode_rank(decode, need, start=self._decode_ranks.step())
        if demand.prompt_tokens < self._direct_max:
            return Pair(None, decode_target)
        if not prefills:
            raise NoInstance("prefill")
        prefill = min(self._prefill_rotation.order(prefills),
                      key=lambda c: (c.queued_prompt_tokens, c.queued_requests))
        return Pair(prefill_rank(prefill, start=self._prefill_ranks.step()), decode_target)

    def _decode(self, decodes: Sequence[Candidate], demand: Demand) -> Candidate:
        if not decodes:
            raise NoInstance("decode")
        ordered = self._decode_rotation.order(decodes)
        fits = [c for c in ordered if c.fits(c.pages_for(demand.tokens_to_reserve))]
        # none can hold it now: the one with the most free pages starts it soonest
        return max(fits or ordered, key=lambda c: (c.free_pages, -c.queued_requests))


class PrefixIndex:
    """What this router believes each prefix cache holds: per instance, and per DP rank of an instance with DP
    attention (each rank has its own prefix cache), the page keys (chained, as ``engine.prefix_cache``
    computes them) of the prompts it sent there, least recently sent evicted first beyond
    ``max_pages_per_instance``; an instance that restarted (a new ``Target.epoch``) starts empty. An estimate
    (SGLang's router keeps an approximate tree of the same kind): it does not see the engine's own evictions
    or other routers' requests, so it only biases the choice and never decides correctness. Router event loop
    thread only.

    Args:
        max_pages_per_instance: keys kept per instance, or per rank (~ the pages of one KV pool).
    """

    def __init__(self, max_pages_per_instance: int = 4096) -> None:
        self._max = max_pages_per_instance
        # (instance id, DP rank or None) → (epoch, keys)
        self._keys: dict[tuple[str, int | None], tuple[int, OrderedDict[PageHash, None]]] = {}

    def _held(self, target: Target) -> OrderedDict[PageHash, None] | None:
        entry = self._keys.get((target.instance_id, target.dp_rank))
        return entry[1] if entry is not None and entry[0] == target.epoch else None

    def hit_pages(self, target: Target, keys: Sequence[PageHash]) -> int:
        """How many leading ``keys`` the instance (its rank ``target.dp_rank``) is believed to hold."""
        held = self._held(target)
        n = 0
        while held and n < len(keys) and keys[n] in held:
            n += 1
        return n

    def record(self, target: Target, keys: Sequence[PageHash]) -> None:
        """The prompt with these page keys was sent to the instance, on ``target.dp_rank`` (its engine will
        cache those pages there)."""
        held = self._held(target)
        if held is None:
            held = OrderedDict()
            self._keys[(target.instance_id, target.dp_rank)] = (target.epoch, held)
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._max:
            held.popitem(last=False)


class CacheAwarePairing(LoadAwarePairing):
    """``LoadAwarePairing`` with prefix-cache credit from a ``PrefixIndex``.

    Prefill: the least work before this prompt's first token, ``queued_prompt_tokens - hit_tokens`` (the
    prompt tokens a hit lets the instance skip, counted against the queue ahead), so a long shared prefix
    outweighs a short queue and an idle instance still wins over a busy one with a small hit. Decode: among
    instances that can hold prompt + max_tokens with the hit pages shared (they need not be allocated), the
    most ``free_pages + hit_pages``: memory still decides, and the hit (which saves the transfer of those
    pages) breaks near ties. With no token ids (an estimated count) it is ``LoadAwarePairing``.

    DP attention: the index is kept per rank; an instance is credited with its best rank's hit, and within
    the chosen instance the rank is chosen with each rank's own hit (``serving.router.ranks``), so a prompt
    whose prefix was prefilled on rank r goes back to rank r unless another rank is less loaded by more than
    the hit saves.
    """

    def __init__(self, direct_decode_max_tokens: int = 0, index: PrefixIndex | None = None) -> None:
        super().__init__(direct_decode_max_tokens)
        self.index = index or PrefixIndex()

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair:
        keys: dict[int, list[PageHash]] = {}

        def page_keys(c: Candidate) -> list[PageHash]:
            if c.page_size not in keys:
                keys[c.page_size] = demand.cacheable_page_keys(c.page_size)
            return keys[c.page_size]

        def rank_hit(c: Candidate) -> Callable[[int], int]:
            return lambda rank: self.index.hit_pages(replace(c.target, dp_rank=rank), page_keys(c))

        def hit(c: Candidate) -> int:
            """The instance's credit: its best rank's hit (its own for an instance of one pool)."""
            if not c.ranks:
                return self.index.hit_pages(c.target, page_keys(c))
            return max(map(rank_hit(c), range(len(c.ranks))))

        if not decodes:
            raise NoInstance("decode")
        ordered = self._decode_rotation.order(decodes)
        hits = {c.target.instance_id: hit(c) for c in ordered}
        fits = [c for c in ordered
                if c.fits(c.pages_for(demand.tokens_to_reserve) - hits[c.target.instance_id])]
        decode = max(fits or ordered,
                     key=lambda c: (c.free_pages + hits[c.target.instance_id], -c.queued_requests))
        decode_target = decode_rank(decode, decode.pages_for(demand.tokens_to_reserve), rank_hit(decode),
                                    self._decode_ranks.step())
        self.index.record(decode_target, page_keys(decode))
        if demand.prompt_tokens < self._direct_max:
            return Pair(None, decode_target)
        if not prefills:
            raise NoInstance("prefill")
        prefill = min(self._prefill_rotation.order(prefills),
                      key=lambda c: (c.queued_prompt_tokens - hit(c) * c.page_size, c.queued_requests))
        prefill_target = prefill_rank(prefill, rank_hit(prefill), self._prefill_ranks.step())
        self.index.record(prefill_target, page_keys(prefill))
        return Pair(prefill_target, decode_target)


class RoundRobinPairing:
    def __init__(self, direct_decode_max_tokens: int = 0) -> None:
        self._direct_max = direct_decode_max_tokens
        self._prefill_rotation = _Rotation()
        self._decode_rotation = _Rotation()
        self._prefill_ranks = _Rotation()
        self._decode_ranks = _Rotation()

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair:
        """Instances in turn; on an instance with DP attention, its least-loaded rank."""
        if not decodes:
            raise NoInstance("decode")
        candidate = self._decode_rotation.order(decodes)[0]
        decode = decode_rank(candidate, candidate.pages_for(demand.tokens_to_reserve),
                             start=self._decode_ranks.step())
        if demand.prompt_tokens < self._direct_max:
            return Pair(None, decode)
        if not prefills:
            raise NoInstance("prefill")
        return Pair(prefill_rank(self._prefill_rotation.order(prefills)[0],
                                 start=self._prefill_ranks.step()), decode)


def make_policy(name: str, direct_decode_max_tokens: int = 0) -> PairingPolicy:
    """``"cache_aware"``, ``"load_aware"`` or ``"round_robin"``. Raises ValueError on another name."""
    if name == "cache_aware":
        return CacheAwarePairing(direct_decode_max_tokens)
    if name == "load_aware":
        return LoadAwarePairing(direct_decode_max_tokens)
    if name == "round_robin":
        return RoundRobinPairing(direct_decode_max_tokens)
    raise ValueError(f"unknown pairing policy {name!r}")
