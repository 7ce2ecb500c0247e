"""Both membership backends against their real store (the registry's own process, a real etcd): 2 routers and
3 workers converge on one fleet; a stopped worker leaves at once, a killed one within its TTL; a killed store
freezes every view (``fresh=False``, last members kept) while announcing keeps retrying; a restarted store
(registry: empty; etcd: same data dir) has every member back and every view fresh within seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from membership_stores import ETCD, NO_ETCD, EtcdProcess, RegistryProcess, WorkerProcess, wait_until

from bootstrap.membership import Member, Membership, make_membership

SECRET = b"fleet secret of the membership tests"
TTL_S = 3.0   # seconds; the bounds below leave room for a loaded machine


@pytest.fixture(params=["registry", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RegistryProcess | EtcdProcess]:
    if request.param == "etcd" and ETCD is None:
        pytest.skip(NO_ETCD)
    server = RegistryProcess(tmp_path, SECRET) if request.param == "registry" else EtcdProcess(tmp_path)
    server.start()
    yield server
    server.kill()


class Fleet:
    """In-process ``Membership`` clients of one store; every one is stopped at teardown."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.clients: list[Membership] = []

    def join(self, instance_id: str, role: str) -> tuple[Membership, Member]:
        membership = make_membership(self.url, SECRET)
        assert membership is not None
        member = Member(instance_id, role, "127.0.0.1:8001", "m",
                        "" if role == "router" else "http://127.0.0.1:9",
                        time.time_ns())
        membership.announce(member, TTL_S)
        membership.start()
        self.clients.append(membership)
        return membership, member

    def ids_seen(self) -> list[set[str]]:
        return [{m.instance_id for m in c.view().members} for c in self.clients]

    def all_see(self, ids: set[str], fresh: bool = True) -> bool:
        return all(c.view().fresh == fresh for c in self.clients) and all(s == ids for s in self.ids_seen())

    def close(self) -> None:
        for client in self.clients:
            client.stop()


@pytest.fixture
def fleet(store: RegistryProcess | EtcdProcess) -> Iterator[Fleet]:
    f = Fleet(store.url)
    yield f
    f.close()


def _five(fleet: Fleet) -> set[str]:
    """Joins 2 routers and 3 workers (each its own client); their ids."""
    ids = [(f"router@127.0.0.1:800{i}/r{i}", "router") for i in range(2)]
    ids += [(f"{role}{i}@127.0.0.1:90{i}", role) for i, role in enumerate(["prefill", "prefill", "decode"])]
    for instance_id, role in ids:
        fleet.join(instance_id, role)
    return {instance_id for instance_id, _ in ids}


def test_routers_and_workers_converge_on_one_fleet(fleet: Fleet) -> None:
    ids = _five(fleet)
    wait_until(lambda: fleet.all_see(ids), 5.0, "all 5 clients see the same 5 members, fresh")
    views = [c.view() for c in fleet.clients]
    assert all(v.members == views[0].members for v in views)
    assert {m.role for m in views[0].members} == {"router", "prefill", "decode"}


def test_a_stopped_worker_leaves_at_once_and_a_killed_one_within_its_ttl(
        fleet: Fleet, tmp_path: Path) -> None:
    ids = _five(fleet)
    killed = WorkerProcess()
    killed.start(fleet.url, "decode9@127.0.0.1:999", "decode", TTL_S, tmp_path, SECRET)
    try:
        wait_until(lambda: fleet.all_see(ids | {"decode9@127.0.0.1:999"}), 15.0, "the worker process joined")
        stopped = fleet.clients.pop(2)   # prefill0
        stopped.stop()
        took_s = wait_until(lambda: fleet.all_see(
            ids - {"prefill0@127.0.0.1:900"} | {"decode9@127.0.0.1:999"}),
                            TTL_S, "a stopped worker leaves every view before its TTL")
        assert took_s < TTL_S
        killed.kill()
        wait_until(lambda: fleet.all_see(ids - {"prefill0@127.0.0.1:900"}), TTL_S + 2.0,
                   "a killed worker leaves every view within its TTL (+ one refresh)")
    finally:
        killed.kill()


def test_a_killed_store_freezes_the_views_and_a_restarted_one_recovers_them(
        store: RegistryProcess | EtcdProcess, fleet: Fleet) -> None:
    ids = _five(fleet)
    wait_until(lambda: fleet.all_see(ids), 5.0, "the fleet converged")
    store.kill()
    wait_until(lambda: all(not c.view().fresh for c in fleet.clients), 5.0, "every view marked stale")
    assert fleet.all_see(ids, fresh=False), "a stale view keeps the last members"
    late, _ = fleet.join("decode7@127.0.0.1:907", "decode")      # announcing during the outage never raises
    time.sleep(2 * TTL_S)                                         # longer than every TTL: keep retrying
    assert all(s == ids for s in fleet.ids_seen()[:-1]) and not late.view().fresh
    store.start()
    took_s = wait_until(lambda: fleet.all_see(ids | {"decode7@127.0.0.1:907"}), 10.0,
                        "every member back and every view fresh after the store restarted")
    print(f"recovered {took_s:.2f} s after the store answered again")
