"""``RegistryMembers``: the fleet's members as its membership registry announces them (``bootstrap.membership``:
the embedded registry service or etcd). The registry's loss freezes the member list (its last view), it never
empties it: the fleet watcher keeps asking each known member's own rendezvous for its health.

Threads: the membership client runs its own thread; ``members`` (the fleet watcher's thread) only reads its view.
"""

from __future__ import annotations

import logging

from bootstrap.membership import Membership, MembershipError, make_membership
from serving.router.discovery import FleetMember

logger = logging.getLogger(__name__)
KV_ROLES = ("prefill", "decode")


class RegistryMembers:
    """A ``MemberSource`` over a started ``Membership`` client."""

    def __init__(self, registry_url: str, secret: bytes | None) -> None:
        """Raises ``MembershipError`` for a URL no backend takes."""
        membership: Membership | None = make_membership(registry_url, secret)
        if membership is None:
            raise MembershipError("RegistryMembers needs a registry URL")
        self._membership = membership
        self._membership.start()

    def members(self) -> tuple[list[FleetMember], bool]:
        view = self._membership.view()
        return [FleetMember(m.instance_id, m.role, m.address, m.model_name, m.rendezvous_url, m.epoch)
                for m in view.members if m.role in KV_ROLES and m.rendezvous_url], view.fresh

    def forget(self, instance_id: str) -> None:
        """Nothing to learn anew: the registry's next view says whether the instance came back."""

    def close(self) -> None:
        self._membership.stop()
