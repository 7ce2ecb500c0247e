"""Pairing policies: which prefill and which decode instance serve one request.

``LoadAwarePairing`` (default): the prefill with the least queued prompt tokens (the work ahead of the new
prompt, so the least TTFT), and the decode with the most free KV pages among those that can hold prompt +
max_tokens right now (decode reserves that much up front; one that cannot must queue the request). Ties go
round robin, so an idle fleet still spreads requests. ``RoundRobinPairing`` cycles through the healthy
instances of each role. Both may send a prompt shorter than ``direct_decode_max_tokens`` to a decode instance
alone (it prefills the prompt itself: no transfer, no prefill queue), as llm-d and Dynamo do for short prompts.

Policies are pure: they see ``Candidate``s (healthy instances with their load) and a ``Demand``, and run on the
router's event loop thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from serving.router.fleet import Candidate, Target


@dataclass(frozen=True)
class Demand:
    """What one request needs: ``prompt_tokens`` (after the chat template) and ``max_tokens``."""

    prompt_tokens: int
    max_tokens: int

    @property
    def tokens_to_reserve(self) -> int:
        """Tokens decode reserves pages for (the last sampled token's KV is never written)."""
        return self.prompt_tokens + self.max_tokens - 1


@dataclass(frozen=True)
class Pair:
    """The instances of one attempt; ``prefill`` None: direct decode (decode prefills the prompt itself)."""

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
    """Round-robin tie breaking: each call starts one position further."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        start = next(self._counter) % len(candidates)
        return [*candidates[start:], *candidates[:start]]


class LoadAwarePairing:
    def __init__(self, direct_decode_max_tokens: int = 0) -> None:
        self._direct_max = direct_decode_max_tokens
        self._prefill_rotation = _Rotation()
        self._decode_rotation = _Rotation()

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair:
        decode = self._decode(decodes, demand)
        if demand.prompt_tokens < self._direct_max:
            return Pair(None, decode)
        if not prefills:
            raise NoInstance("prefill")
        prefill = min(self._prefill_rotation.order(prefills),
                      key=lambda c: (c.queued_prompt_tokens, c.queued_requests))
        return Pair(prefill.target, decode)

    def _decode(self, decodes: Sequence[Candidate], demand: Demand) -> Target:
        if not decodes:
            raise NoInstance("decode")
        ordered = self._decode_rotation.order(decodes)
        fits = [c for c in ordered if c.free_pages >= c.pages_for(demand.tokens_to_reserve)]
        # none can hold it now: the one with the most free pages starts it soonest
        return max(fits or ordered, key=lambda c: (c.free_pages, -c.queued_requests)).target


class RoundRobinPairing:
    def __init__(self, direct_decode_max_tokens: int = 0) -> None:
        self._direct_max = direct_decode_max_tokens
        self._prefill_rotation = _Rotation()
        self._decode_rotation = _Rotation()

    def choose(self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], demand: Demand) -> Pair:
        if not decodes:
            raise NoInstance("decode")
        decode = self._decode_rotation.order(decodes)[0].target
        if demand.prompt_tokens < self._direct_max:
            return Pair(None, decode)
        if not prefills:
            raise NoInstance("prefill")
        return Pair(self._prefill_rotation.order(prefills)[0].target, decode)


def make_policy(name: str, direct_decode_max_tokens: int = 0) -> PairingPolicy:
    """``"load_aware"`` or ``"round_robin"``. Raises ValueError on another name."""
    if name == "load_aware":
        return LoadAwarePairing(direct_decode_max_tokens)
    if name == "round_robin":
        return RoundRobinPairing(direct_decode_max_tokens)
    raise ValueError(f"unknown pairing policy {name!r}")
