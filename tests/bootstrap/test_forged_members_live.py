"""Forged fleet members, against the real stores (issue 44, attack 4): an attacker who can write the store but
does not hold the fleet secret adds fake prefill and decode members, redirects a member to its own address,
copies a genuine record to another key, replays an older record. A fleet process reading membership with the
secret (a ``make_membership`` reader, and the router's own member source ``RegistryMembers``) never lists any
of them, logs each, and keeps listing the genuine members.

Stores: etcd without auth (the attacker writes keys straight through etcdctl, in the layout our backend uses),
and the embedded registry started without a secret (an open or compromised registry: the readers' own check is
the one that counts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from membership_stores import ETCD, ETCDCTL, NO_ETCD, EtcdProcess, wait_until

from bootstrap.membership import MEMBER_VERSION, Member, Membership, RegistryServer, make_membership
from bootstrap.membership.etcd import PREFIX
from serving.router.registry_members import RegistryMembers

SECRET = b"fleet secret of the forged-member tests"
OTHER_SECRET = b"a secret of another fleet"
TTL_S = 3.0
ATTACKER = "10.66.6.6"   # the address the attacker wants requests sent to


def _member(role: str, host: str, port: int, epoch: int | None = None) -> Member:
    return Member(f"{role}@{host}:{port}", role, f"{host}:{port}", role, f"http://{host}:{port + 1}",
                  time.time_ns() if epoch is None else epoch)


class Readers:
    """A writer announcing the genuine prefill and decode, and two readers with the fleet secret (three
    clients of the store: the writer reads it too)."""

    def __init__(self, url: str) -> None:
        self.genuine = [_member("prefill", "127.0.0.1", 8101), _member("decode", "127.0.0.1", 8201)]
        writer = make_membership(url, SECRET)
        reader = make_membership(url, SECRET)
        assert writer is not None and reader is not None
        self.writer: Membership = writer
        self.reader: Membership = reader
        for member in self.genuine:
            self.writer.announce(member, TTL_S)
        self.writer.start()
        self.reader.start()
        self.router = RegistryMembers(url, SECRET)

    def listed(self) -> list[set[tuple[str, str, int]]]:
        """What each reader lists: (instance id, address, epoch) per member."""
        view = {(m.instance_id, m.address, m.epoch) for m in self.reader.view().members}
        router = {(m.instance_id, m.address, m.epoch) for m in self.router.members()[0]}
        return [view, router]

    def only_genuine(self) -> bool:
        want = {(m.instance_id, m.address, m.epoch) for m in self.genuine}
        return all(listed == want for listed in self.listed()) and len(self.reader.view().members) == 2

    def close(self) -> None:
        self.router.close()
        self.reader.stop()
        self.writer.stop()


def _hold(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    """``predicate`` holds at every poll (every 50 ms) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.05)


def _no_attacker(readers: Readers) -> bool:
    return not any(ATTACKER in address for listed in readers.listed() for _, address, _ in listed)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    if ETCD is None or ETCDCTL is None:
        pytest.skip(NO_ETCD)
    server = EtcdProcess(tmp_path)
    server.start()
    yield server
    server.kill()


def test_members_forged_in_an_etcd_without_auth_are_never_listed(
        etcd: EtcdProcess, caplog: pytest.LogCaptureFixture) -> None:
    readers = Readers(etcd.url)
    caplog.set_level(logging.WARNING, logger="bootstrap.membership")
    try:
        wait_until(readers.only_genuine, 5.0, "both readers list the genuine prefill and decode")
        fakes = [_member("prefill", ATTACKER, 8001), _member("decode", ATTACKER, 8001)]
        for fake in fakes:   # no credentials, no signature: the attack of issue 44
            etcd.etcdctl("put", PREFIX + fake.instance_id, fake.to_json())
        _hold(readers.only_genuine, 1.5, "a reader lists an unsigned member")
        foreign = _member("decode", ATTACKER, 9001).signed(OTHER_SECRET)
        etcd.etcdctl("put", PREFIX + foreign.instance_id, foreign.to_json())
        decode_key = PREFIX + readers.genuine[1].instance_id
        copied_key = PREFIX + f"decode@{ATTACKER}:7001"
        etcd.etcdctl("put", copied_key, etcd.etcdctl("get", "--print-value-only", decode_key).strip())
        _hold(readers.only_genuine, 1.5, "a reader lists a foreign or moved record")
        keys = [PREFIX + fake.instance_id for fake in fakes] + [PREFIX + foreign.instance_id, copied_key]
        wait_until(lambda: all(key in caplog.text for key in keys), 2.0, "every forged key logged")
        assert caplog.text.count(f"{fakes[0].instance_id} of etcd://") == 3, "once per reading client"
        assert "unsigned member record" in caplog.text and "bad member record signature" in caplog.text
        assert f"is under the key of 'decode@{ATTACKER}:7001'" in caplog.text

        redirect = Member(readers.genuine[1].instance_id, "decode", f"{ATTACKER}:8201", "decode",
                          f"http://{ATTACKER}:8202", readers.genuine[1].epoch + 1)
        etcd.etcdctl("put", decode_key, redirect.to_json())   # the genuine decode's key, the attacker's host
        _hold(lambda: _no_attacker(readers), 2.0, "a reader lists the attacker's address")
        wait_until(readers.only_genuine, 3 * TTL_S, "the genuine decode put back by its writer")

        old = etcd.etcdctl("get", "--print-value-only", decode_key).strip()
        restarted = _member("decode", "127.0.0.1", 8201)   # the decode instance restarts: a newer epoch
        readers.writer.announce(restarted, TTL_S)
        readers.genuine[1] = restarted
        wait_until(readers.only_genuine, 5.0, "the restarted decode listed")
        etcd.etcdctl("put", decode_key, old)   # a replayed record of the earlier process
        _hold(lambda: all(restarted.epoch >= e for listed in readers.listed() for _, _, e in listed), 1.0,
              "the replayed older epoch listed")
        wait_until(lambda: "older than epoch" in caplog.text, 2.0, "the replay logged")
        wait_until(readers.only_genuine, 3 * TTL_S, "the restarted decode put back by its writer")
    finally:
        readers.close()


def test_members_forged_in_an_open_registry_are_never_listed(caplog: pytest.LogCaptureFixture) -> None:
    registry = RegistryServer("127.0.0.1", 0, None, ttl_s=TTL_S)   # checks nothing: as if compromised
    registry.start()
    readers = Readers(registry.url)
    caplog.set_level(logging.WARNING, logger="bootstrap.membership")
    try:
        wait_until(readers.only_genuine, 5.0, "both readers list the genuine prefill and decode")
        fakes = [_member("prefill", ATTACKER, 8001), _member("decode", ATTACKER, 8001)]
        for fake in fakes:   # the registry stores whatever it is sent
            _put(registry, fake)
        _hold(readers.only_genuine, 1.5, "a reader lists an unsigned member")
        fakes.append(_member("decode", ATTACKER, 9001).signed(OTHER_SECRET))
        _put(registry, fakes[-1])
        _hold(readers.only_genuine, 1.5, "a reader lists a member signed with another secret")
        for fake in fakes:
            line = f"/v1/members/{fake.instance_id} of {registry.url}"
            wait_until(lambda line=line: line in caplog.text, 2.0, f"{fake.instance_id} logged")
        logged = caplog.text.count(f"/v1/members/{fakes[0].instance_id} of")
        assert logged == 3, "once per client, not once per poll"
    finally:
        readers.close()
        registry.stop()


def _put(registry: RegistryServer, member: Member) -> None:
    """A PUT without any signature, as anyone who reaches the registry can send."""
    body = {"version": MEMBER_VERSION, "member": member.to_dict(), "ttl_s": 60}
    response = requests.put(f"{registry.url}/v1/members/{member.instance_id}", json=body, timeout=5)
    assert response.status_code == 200, response.text
