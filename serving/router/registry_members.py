"""``RegistryMembers``: the fleet's members as its membership registry announces them
(``bootstrap.membership``: the embedded registry service or etcd). The registry's loss freezes the member list
(its last view), it never empties it: the fleet watcher keeps asking each known member's own rendezvous for
its health. A member the registry stops listing stays a member for ``grace_s`` more (a registry restarted
empty lists the fleet again within one renewal); one whose rendezvous refuses a connection leaves at once
(``forget``).

Threads: the membership client runs its own thread; ``members`` (the fleet watcher's thread) only reads its
view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bootstrap.membership import Membership, MembershipError, make_membership
from serving.router.discovery import FleetMember

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

logger = logging.getLogger(__name__)
KV_ROLES = ("prefill", "decode")
#: How long a member the registry no longer lists is kept: longer than the workers' renewal period (a third of
#: their 10 s TTL), so a registry restarted empty never empties the fleet, seconds.
GRACE_S = 10.0


class RegistryMembers:
    """A ``MemberSource`` over a started ``Membership`` client."""

    def __init__(self, registry_url: str, secret: bytes | None, grace_s: float = GRACE_S,
                 tls: FleetTLS | None = None, etcd_settings: Mapping[str, str] | None = None) -> None:
        """``tls``: the fleet's TLS setting (an ``https://`` registry); ``etcd_settings``: etcd's own auth and
        TLS (``RouterConfig.etcd_settings``). Raises ``MembershipError`` for a URL no backend takes, or an
        ``http://`` one with TLS."""
        self._grace_s = grace_s
        # instance id → member, last listed (monotonic)
        self._seen: dict[str, tuple[FleetMember, float]] = {}
        self._refused: set[tuple[str, int]] = set()   # (instance id, epoch) whose rendezvous refused: gone
        membership: Membership | None = make_membership(registry_url, secret, etcd_settings, tls=tls)
        if membership is None:
            raise MembershipError("RegistryMembers needs a registry URL")
        self._membership = membership
        self._membership.start()

    def members(self) -> tuple[list[FleetMember], bool]:
        view, now_s = self._membership.view(), time.monotonic()
        listed = {(m.instance_id, m.epoch) for m in view.members}
        self._refused &= listed   # the registry dropped it (TTL): nothing left to skip
        for m in view.members:
            if m.role in KV_ROLES and m.rendezvous_url and (m.instance_id, m.epoch) not in self._refused:
                member = FleetMember(m.instance_id, m.role, m.address, m.model_name, m.rendezvous_url,
                                     m.epoch)
                self._seen[m.instance_id] = (member, now_s)
        for instance_id, (_, seen_s) in list(self._seen.items()):
            if now_s - seen_s > self._grace_s:
                del self._seen[instance_id]
        return [member for member, _ in self._seen.values()], view.fresh

    def forget(self, instance_id: str) -> None:
        """Its rendezvous refused: gone, and not polled again while the registry still lists that epoch (until
        its TTL ends); a restart announces itself with a new epoch."""
        seen = self._seen.pop(instance_id, None)
        if seen is not None:
            self._refused.add((instance_id, seen[0].epoch))

    def close(self) -> None:
        self._membership.stop()
