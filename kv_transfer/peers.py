"""Peers of a manager: handshake once per peer (fetch its registration from the peer's own rendezvous, check
compatibility, load the agent).

A peer is cached by instance id and re-handshaked only when its registration shows a new agent (a restart).
Liveness is asked of the peer itself: its rendezvous lives in its process, so a refused connection means the
process is gone (declared lost at once), while a peer that does not answer (a stall, a partition) is declared
lost only after ``peer_lost_s`` without an answer. Called from the manager thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from bootstrap.client import ClientPool
from bootstrap.errors import BootstrapError, RendezvousRefused
from bootstrap.messages import Registration
from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.blocks import BlockTable
from kv_transfer.errors import CompatibilityError
from kv_transfer.head_slices import KVRegion, coverage_problem
from kv_transfer.layout import KVLayout, check_compatible
from kv_transfer.transport import Transport

logger = logging.getLogger(__name__)


def kv_info(model_id: str, layout: KVLayout, kv_base_ptr: int, aux_base_ptr: int,
            aux_slots: int, kv_regions: tuple[KVRegion, ...] = ()) -> dict[str, Any]:
    """The KV part of a registration (what a peer needs to check us and address our memory);
    ``kv_regions`` only for a tensor-parallel instance (``[head_start, head_stop, base_ptr]`` each)."""
    info = {"model_id": model_id, "layout": layout.to_json(), "kv_base_ptr": kv_base_ptr,
            "aux_base_ptr": aux_base_ptr, "aux_slots": aux_slots, "aux_slot_bytes": AUX_SLOT_BYTES}
    if kv_regions:
        info["kv_regions"] = [r.to_json() for r in kv_regions]
    return info


def peer_regions(info: dict[str, Any], layout: KVLayout, ours: KVLayout) -> tuple[KVRegion, ...]:
    """A peer's KV regions from its ``kv_info`` (empty: one pool). Raises ``CompatibilityError``
    (``kv_regions``) when they cannot be mapped onto ours: malformed, or a model KV head no rank holds."""
    raw = info.get("kv_regions")
    if not raw:
        return ()
    try:
        regions = tuple(KVRegion.from_json(r) for r in raw)
    except (TypeError, ValueError) as exc:
        raise CompatibilityError("kv_regions", "a list of [head_start, head_stop, base_ptr]", raw) from exc
    problem = coverage_problem(regions, layout.num_kv_heads)
    if problem is not None:
        raise CompatibilityError("kv_regions", f"every KV head of {ours.num_kv_heads} held", problem)
    return regions


@dataclass(frozen=True)
class Peer:
    instance_id: str
    agent_name: str
    epoch: int
    table: BlockTable   # the peer's memory, in its own index space
    rendezvous_url: str = ""

    @property
    def layout(self) -> KVLayout:
        return self.table.layout


class PeerTable:
    def __init__(self, clients: ClientPool, transport: Transport, model_id: str,
                 layout: KVLayout, peer_lost_s: float = 10.0, silence_gap_s: float = 5.0) -> None:
        """``peer_lost_s``: how long a peer's rendezvous may not answer before it is lost, seconds.
        ``silence_gap_s``: unanswered checks further apart than this are two silences, not one (a peer is
        checked only while it has open rooms: a silence that ended unseen must not count into the next
        one)."""
        self._clients = clients
        self._transport = transport
        self._model_id = model_id
        self._layout = layout
        self._peer_lost_s = peer_lost_s
        self._silence_gap_s = silence_gap_s
        self._peers: dict[str, Peer] = {}
        # agent name → (instance id, rendezvous URL), of peers forgotten (last 64)
        self._forgotten: dict[str, tuple[str, str]] = {}
        # instance id → (first, last) unanswered liveness check of its current silence
        self._silent_since_s: dict[str, tuple[float, float]] = {}
        self.handshakes_total = 0

    def get(self, instance_id: str) -> Peer | None:
        return self._peers.get(instance_id)

    def ensure(self, instance_id: str, rendezvous_url: str, expected_agent: str | None = None) -> Peer:
        """The handshaked peer; handshakes on first use, when ``expected_agent`` differs from the cached one,
        or when the peer now lives at another rendezvous URL (a restart). Raises ``LookupError`` (not
        registered there), ``CompatibilityError``, ``TransportError``, ``BootstrapError``
        (``RendezvousRefused``: nothing listens at ``rendezvous_url``).
        """
        peer = self._peers.get(instance_id)
        if peer is not None and (expected_agent is None or peer.agent_name == expected_agent) \
                and (not rendezvous_url or peer.rendezvous_url == rendezvous_url):
            return peer
        url = rendezvous_url or (peer.rendezvous_url if peer is not None else "")
        registration = self._clients.get(url).get_instance(instance_id)
        if registration is None:
            raise LookupError(f"instance {instance_id} is not registered")
        if expected_agent is not None and registration.agent_name != expected_agent:
            raise LookupError(f"instance {instance_id} now runs agent {registration.agent_name}, "
                              f"not {expected_agent}")
        return self._handshake(registration, url)

    def check_alive(self, instance_id: str, now_s: float) -> bool:
        """False (and the peer forgotten) when the instance is gone or restarted since the handshake: its
        rendezvous refuses connections, no longer knows it or names another agent, or has not answered for
        ``peer_lost_s``. Raises ``BootstrapError`` for an unanswered check within that grace (unknown yet)."""
        peer = self._peers.get(instance_id)
        if peer is None:
            return False
        try:
            registration = self._clients.get(peer.rendezvous_url).get_instance(instance_id)
        except RendezvousRefused:
            registration = None
        except BootstrapError:
            since_s, last_s = self._silent_since_s.get(instance_id, (now_s, now_s))
            if now_s - last_s > self._silence_gap_s:   # an earlier silence, which ended unseen: a new one
                since_s = now_s
            self._silent_since_s[instance_id] = (since_s, now_s)
            if now_s - since_s < self._peer_lost_s:
                raise
            registration = None
        self._silent_since_s.pop(instance_id, None)
        if registration is not None and registration.agent_name == peer.agent_name:
            return True
        self.forget(instance_id)
        return False

    def heard_from(self, instance_id: str) -> None:
        """The peer showed it is alive (it posted a destination, a WRITE to it completed, a notification came
        from it): a silence of its rendezvous so far is over. Any thread (one dict removal)."""
        self._silent_since_s.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        peer = self._peers.pop(instance_id, None)
        if peer is not None:
            self._transport.remove_peer(peer.agent_name)
            self._forgotten[peer.agent_name] = (instance_id, peer.rendezvous_url)
            self._silent_since_s.pop(instance_id, None)
            while len(self._forgotten) > 64:
                del self._forgotten[next(iter(self._forgotten))]
            logger.info("forgot peer %s (agent %s)", instance_id, peer.agent_name)

    def recover(self, agent_name: str) -> Peer | None:
        """A forgotten peer that turned out alive with the same agent (it stalled past its registration TTL,
        e.g. a stopped process, then registered again) is handshaked again; None when ``agent_name`` was never
        forgotten here. Raises like ``ensure`` (``LookupError`` when the instance now runs another agent)."""
        forgotten = self._forgotten.get(agent_name)
        if forgotten is None:
            return None
        instance_id, url = forgotten
        peer = self.ensure(instance_id, url, agent_name)
        self._forgotten.pop(agent_name, None)
        return peer

    def _handshake(self, registration: Registration, rendezvous_url: str) -> Peer:
        info = registration.kv_info
        layout = KVLayout.from_json(info["layout"])
        check_compatible(self._model_id, self._layout, str(info["model_id"]), layout,
                         registration.compat_hash, their_sliced=bool(info.get("kv_regions")))
        if int(info["aux_slot_bytes"]) != AUX_SLOT_BYTES:
            raise CompatibilityError("aux_slot_bytes", AUX_SLOT_BYTES, info["aux_slot_bytes"])
        table = BlockTable(int(info["kv_base_ptr"]), layout, int(info["aux_base_ptr"]),
                           int(info["aux_slots"]), peer_regions(info, layout, self._layout))
        self.forget(registration.instance_id)
        agent_name = self._transport.add_peer(registration.agent_metadata, table)
        peer = Peer(registration.instance_id, agent_name, registration.epoch, table, rendezvous_url)
        self._peers[registration.instance_id] = peer
        self.handshakes_total += 1
        logger.info("handshake with %s done (agent %s, epoch %d)", peer.instance_id, agent_name, peer.epoch)
        return peer
