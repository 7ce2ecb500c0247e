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


def test_unknown_peers_are_refused(registry: Registry) -> None:
    assert "unknown prefill" in registry.post_destination(
        Destination(1, "nope", "d0", "d0#1", "x", [1], 0), 1.0).reason
    assert "unknown decode" in registry.post_destination(dest(1, "ghost"), 1.0).reason


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


def test_abort_log_is_read_with_a_cursor_and_pruned(registry: Registry) -> None:
    registry.abort_room(11, 1.0)
    registry.abort_room(12, 2.0)
    rooms, cursor, _ = registry.aborts_after(-1)
    assert rooms == [11, 12]
    registry.abort_room(13, 3.0)
    assert registry.aborts_after(cursor) == ([13], cursor + 1, [])
    assert registry.aborts_after(cursor + 1) == ([], cursor + 1, [])
    registry.expire(102.5)  # 11 and 12 are older than room_ttl_s
    assert registry.aborts_after(-1)[0] == [13]


def test_a_router_whose_lease_ends_is_logged_as_gone_once(registry: Registry) -> None:
    """A router's registration is its lease: expiry or deregistration puts it in the abort log (workers then
    drop its rooms); an engine instance that expires is not a router and is not logged."""
    registry.register(reg("r0", "router"), now_s=0.0)
    registry.register(reg("r1", "router"), now_s=0.0)
    _, cursor, _ = registry.aborts_after(-1)
    assert registry.deregister("r1", 1, now_s=1.0)
    assert registry.heartbeat("r0", 1, 5.0)
    registry.expire(11.0)   # p0, d0, d1 silent since 0.0; r0 heard at 5.0
    assert registry.aborts_after(cursor)[2] == ["r1"]
    registry.expire(16.0)
    assert registry.aborts_after(cursor)[2] == ["r1", "r0"]
    assert registry.instances(16.0) == []


def test_heartbeats_carry_the_load_the_fleet_listing_shows(registry: Registry) -> None:
    load = InstanceLoad(num_queued_requests=2, num_queued_prompt_tokens=300, num_free_pages=7,
                        num_total_pages=9, page_size=16)
    assert registry.heartbeat("d0", 1, 4.0, load)
    listed = {s.instance_id: s for s in registry.instances(5.0)}
    assert listed["d0"].load == load and listed["d0"].age_s == 1.0 and listed["p0"].load == InstanceLoad()
    assert [s.instance_id for s in registry.instances(5.0, role="decode")] == ["d0", "d1"]
