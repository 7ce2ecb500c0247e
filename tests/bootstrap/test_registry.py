"""Registry invariants: rooms are exclusive, delivered once, released by their decode; silence expires."""

from __future__ import annotations

import pytest

from bootstrap.messages import ROOM_IN_USE, Destination, InstanceLoad, Registration
from bootstrap.registry import Registry, RegistryConfig


def reg(instance_id: str, role: str, epoch: int = 1) -> Registration:
    return Registration(instance_id, role, epoch, f"{instance_id}#{epoch}", "", "hash")


def dest(room: int, decode: str = "d0") -> Destination:
    return Destination(room, "p0", decode, f"{decode}#1", "x", [1, 2], 0)


@pytest.fixture
def registry() -> Registry:
    r = Registry(RegistryConfig(registration_ttl_s=10.0, room_ttl_s=100.0))
    for instance_id, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]:
        r.register(reg(instance_id, role), now_s=0.0)
    return r


def test_a_room_in_use_rejects_only_the_second_request(registry: Registry) -> None:
    assert registry.post_destination(dest(5), 1.0).accepted
    second = registry.post_destination(dest(5, "d1"), 1.0)
    assert not second.accepted and second.code == ROOM_IN_USE and "in use" in second.reason
    assert registry.take_destinations("p0") == [dest(5)]


def test_destinations_are_delivered_exactly_once(registry: Registry) -> None:
    registry.post_destination(dest(1), 1.0)
    registry.post_destination(dest(2), 1.0)
    assert {d.room for d in registry.take_destinations("p0")} == {1, 2}
    assert registry.take_destinations("p0") == []


def test_release_says_whether_prefill_had_the_destination(registry: Registry) -> None:
    registry.post_destination(dest(1), 1.0)
    assert not registry.release_room(1, "d0").delivered
    registry.post_destination(dest(1), 1.0)
    registry.take_destinations("p0")
    assert registry.release_room(1, "d1").known is False  # only the room's decode may release it
    assert registry.release_room(1, "d0").delivered
    assert registry.num_rooms == 0


def test_a_destination_for_another_prefill_is_refused(registry: Registry) -> None:
    """A prefill instance's rendezvous holds its own rooms only; the decode side need not be registered there
    (prefill fetches decode's registration from decode's own rendezvous)."""
    assert "unknown prefill" in registry.post_destination(
        Destination(1, "nope", "d0", "d0#1", "x", [1], 0), 1.0).reason
    assert "unknown prefill" in registry.post_destination(
        Destination(2, "d0", "d1", "d1#1", "x", [1], 0), 1.0).reason   # d0 is no prefill instance
    assert registry.post_destination(dest(1, "ghost"), 1.0).accepted


def test_silent_instances_expire_with_their_rooms(registry: Registry) -> None:
    registry.post_destination(dest(1), 1.0)
    assert registry.heartbeat("p0", 1, 9.0) and registry.heartbeat("d0", 1, 9.0)
    assert registry.expire(15.0) == ["d1"]
    assert registry.num_rooms == 1
    assert set(registry.expire(25.0)) == {"p0", "d0"} and registry.num_rooms == 0


def test_a_restart_replaces_the_registration_and_drops_its_rooms(registry: Registry) -> None:
    registry.post_destination(dest(1), 1.0)
    registry.register(reg("p0", "prefill", epoch=2), 2.0)
    assert registry.get("p0").agent_name == "p0#2"  # type: ignore[union-attr]
    assert registry.num_rooms == 0
    assert not registry.heartbeat("p0", 1, 3.0)  # the old epoch is gone


def test_stale_rooms_expire_and_room_ids_are_63_bit(registry: Registry) -> None:
    registry.post_destination(dest(1), 1.0)
    for instance_id in ("p0", "d0", "d1"):
        registry.heartbeat(instance_id, 1, 101.5)
    registry.expire(101.5)
    assert registry.num_rooms == 0
    with pytest.raises(ValueError):
        dest(2**63)


def test_heartbeats_carry_the_load_the_fleet_listing_shows(registry: Registry) -> None:
    load = InstanceLoad(num_queued_requests=2, num_queued_prompt_tokens=300, num_free_pages=7,
                        num_total_pages=9, page_size=16)
    assert registry.heartbeat("d0", 1, 4.0, load)
    listed = {s.instance_id: s for s in registry.instances(5.0)}
    assert listed["d0"].load == load and listed["d0"].age_s == 1.0 and listed["p0"].load == InstanceLoad()
    assert [s.instance_id for s in registry.instances(5.0, role="decode")] == ["d0", "d1"]


def test_a_draining_instance_is_listed_as_draining_from_then_on(registry: Registry) -> None:
    """A model being unloaded marks its instance draining (routers pair it no more); only its own epoch
    can."""
    assert not any(s.draining for s in registry.instances(1.0))
    assert not registry.set_draining("d0", epoch=2)   # another incarnation's mark
    assert registry.set_draining("d0", epoch=1)
    assert {s.instance_id: s.draining for s in registry.instances(1.0)} == {
        "d0": True, "d1": False, "p0": False}
    assert registry.heartbeat("d0", 1, 2.0, InstanceLoad(num_free_pages=3))   # its reports keep coming
    assert [s.draining for s in registry.instances(2.0, "decode")] == [True, False]
    assert not registry.set_draining("nobody", epoch=1)


def test_the_same_destination_posted_again_is_accepted_once(registry: Registry) -> None:
    """A decode whose post timed out (a link down: the prefill took it, its answer was lost) posts again: the
    same destination is accepted again and still delivered once; another decode's post of that room is not."""
    assert registry.post_destination(dest(7), 1.0).accepted
    assert registry.take_destinations("p0") == [dest(7)]
    again = registry.post_destination(dest(7), 3.0)
    assert again.accepted and again.prefill_agent_name == "p0#1"
    assert registry.take_destinations("p0") == []
    assert not registry.post_destination(dest(7, "d1"), 3.0).accepted
