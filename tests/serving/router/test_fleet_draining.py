"""A worker whose model is being unloaded (``InstanceStatus.draining``): routers stop pairing it, keep it
known while its streams run on, and ask its model again so that a reload's successor (same instance id, new
epoch, its own rendezvous) takes its place within a refresh. Against real rendezvous servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from router_fakes import fleet_of, status

from bootstrap import Rendezvous, RendezvousConfig
from bootstrap.messages import InstanceLoad, Registration
from serving.router.config import RouterConfig
from serving.router.discovery import FleetMember
from serving.router.fleet import Fleet, FleetWatcher


def test_a_draining_instance_is_never_a_candidate_but_stays_responsive() -> None:
    fleet = fleet_of(status("p0", "prefill"), replace(status("d0", "decode"), draining=True),
                     status("d1", "decode"))
    assert [c.target.instance_id for c in fleet.candidates("decode")] == ["d1"]
    assert fleet.responsive("d0")   # its streams in flight are not given up for silence
    assert fleet.health()["decode"] == {"d0": False, "d1": True}
    assert not fleet_of(status("p0", "prefill"), replace(status("d0", "decode"), draining=True)).ready()


class Members:
    """A ``MemberSource`` whose members the test sets; records what the watcher told it to forget."""

    def __init__(self) -> None:
        self.members_now: list[FleetMember] = []
        self.forgotten: list[str] = []

    def members(self) -> tuple[list[FleetMember], bool]:
        return list(self.members_now), True

    def forget(self, instance_id: str) -> None:
        self.forgotten.append(instance_id)

    def close(self) -> None:
        pass


def _decode_rendezvous(epoch: int) -> Rendezvous:
    rendezvous = Rendezvous(RendezvousConfig(port=0))
    rendezvous.start()
    rendezvous.register(Registration("decode@s:1", "decode", epoch, f"decode#{epoch}", "", "h", "127.0.0.1:1",
                                     model_name="decode", rendezvous_url=rendezvous.url,
                                     load=InstanceLoad(num_free_pages=8, num_total_pages=8, page_size=16)))
    return rendezvous


@pytest.fixture
def rendezvous_pair() -> Iterator[tuple[Rendezvous, Rendezvous]]:
    old, new = _decode_rendezvous(1), _decode_rendezvous(2)
    yield old, new
    old.stop()
    new.stop()


def test_a_reload_successor_replaces_a_draining_instance_within_a_refresh(
        rendezvous_pair: tuple[Rendezvous, Rendezvous]) -> None:
    old, new = rendezvous_pair
    fleet, source = Fleet(RouterConfig()), Members()
    watcher = FleetWatcher(fleet, RouterConfig(), source, "test")
    try:
        source.members_now = [FleetMember("decode@s:1", "decode", "127.0.0.1:1", "decode", old.url, 1)]
        watcher.refresh()
        assert [(c.target.instance_id,
                 c.target.epoch) for c in fleet.candidates("decode")] == [("decode@s:1", 1)]
        assert source.forgotten == []

        assert old.set_draining("decode@s:1", 1)   # the old version's finalize: its model is being unloaded
        watcher.refresh()
        assert fleet.candidates("decode") == [] and fleet.responsive("decode@s:1")
        assert source.forgotten == ["decode@s:1"]   # its model is asked again next round

        # asked again, the server's model answers with its successor's card: the same id, a new epoch
        source.members_now = [FleetMember("decode@s:1", "decode", "127.0.0.1:1", "decode", new.url, 2)]
        watcher.refresh()
        assert [(c.target.instance_id,
                 c.target.epoch) for c in fleet.candidates("decode")] == [("decode@s:1", 2)]
        assert fleet.epochs() == {"decode@s:1": 2}
    finally:
        watcher.stop()
