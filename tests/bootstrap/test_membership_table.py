"""The registry's pure state (``MemberTable``: TTL expiry, the epoch rule) and the ``Member`` wire format."""

from __future__ import annotations

import json

import pytest

from bootstrap.membership import MEMBER_VERSION, Member, MembershipError, make_membership
from bootstrap.membership.etcd import EtcdMembership
from bootstrap.membership.registry_client import RegistryMembership
from bootstrap.membership.table import MemberTable, PutResult


def member(instance_id: str = "m@h:1", epoch: int = 5, role: str = "decode") -> Member:
    return Member(instance_id, role, "h:1", "m", "http://h:2", epoch)


def test_a_member_lives_ttl_seconds_after_its_last_renewal() -> None:
    table = MemberTable()
    assert table.put(member(), 2.0, now_s=100.0) is PutResult.STORED
    assert table.keepalive("m@h:1", 5, now_s=101.5)
    assert table.members(now_s=103.4) == [member()]
    assert table.expire(now_s=103.4) == []
    assert table.members(now_s=103.5) == [], "an expired member is not listed even before expire() runs"
    assert table.expire(now_s=103.5) == [member()]
    assert not table.keepalive("m@h:1", 5, now_s=103.6), "an expired member must put again"


def test_an_older_epoch_never_replaces_a_newer_one() -> None:
    table = MemberTable()
    table.put(member(epoch=7), 10.0, now_s=0.0)
    assert table.put(member(epoch=6), 10.0, now_s=1.0) is PutResult.STALE_EPOCH
    assert table.members(now_s=1.0) == [member(epoch=7)]
    assert table.put(member(epoch=8), 10.0, now_s=1.0) is PutResult.STORED
    assert table.members(now_s=1.0) == [member(epoch=8)]


def test_keepalive_and_delete_act_only_on_the_same_epoch() -> None:
    table = MemberTable()
    table.put(member(epoch=8), 10.0, now_s=0.0)
    assert not table.keepalive("m@h:1", 7, now_s=1.0)
    assert not table.delete("m@h:1", 7), "a stopping predecessor must not remove its successor"
    assert not table.delete("other", 8)
    assert table.delete("m@h:1", 8) and table.members(now_s=1.0) == []


def test_members_are_listed_in_id_order() -> None:
    table = MemberTable()
    for name in ("b@h:1", "a@h:1", "c@h:1"):
        table.put(member(name), 10.0, now_s=0.0)
    assert [m.instance_id for m in table.members(now_s=0.0)] == ["a@h:1", "b@h:1", "c@h:1"]


def test_member_json_round_trips_and_is_versioned() -> None:
    m = Member("router@h:1/0f3c", "router", "h:1", "pd_ensemble", "", 1_700_000_000_000_000_000)
    assert Member.from_json(m.to_json()) == m
    assert json.loads(m.to_json())["version"] == MEMBER_VERSION
    other = {**m.to_dict(), "version": MEMBER_VERSION + 1}
    with pytest.raises(MembershipError, match=f"member version {MEMBER_VERSION + 1} is not {MEMBER_VERSION}"):
        Member.from_dict(other)


@pytest.mark.parametrize("fields, reason", [
    ({"role": "encoder"}, "role must be one of"),
    ({"instance_id": ""}, "instance_id is empty"),
    ({"epoch": "5"}, "epoch must be an int"),
    ({"extra": 1}, "bad member fields"),
])
def test_a_bad_member_is_refused_by_name(fields: dict[str, object], reason: str) -> None:
    with pytest.raises(MembershipError, match=reason):
        Member.from_dict({**member().to_dict(), **fields})


def test_make_membership_picks_the_backend_from_the_url() -> None:
    assert make_membership("", None) is None
    assert isinstance(make_membership("http://127.0.0.1:8997", b"s"), RegistryMembership)
    assert isinstance(make_membership("etcd://127.0.0.1:2379,127.0.0.2:2379", None), EtcdMembership)
    with pytest.raises(MembershipError, match="want '' .none., http://host:port"):
        make_membership("zk://h:1", None)
    with pytest.raises(MembershipError, match="set both PD_ETCD_USER and PD_ETCD_PASSWORD"):
        make_membership("etcd://127.0.0.1:2379", None, {"PD_ETCD_USER": "root"})


def test_announce_refuses_a_ttl_below_one_second() -> None:
    membership = make_membership("http://127.0.0.1:1", None)
    assert membership is not None
    with pytest.raises(MembershipError, match="ttl_s must be >= 1"):
        membership.announce(member(), ttl_s=0.5)
