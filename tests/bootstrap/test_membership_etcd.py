"""``EtcdMembership`` against a real etcd: etcd's own auth (right password works, none or a wrong one fails
with the reason), TLS with client certificates beside it (the recommended set-up: no certificate, no user or
plaintext are refused), a lost lease is granted again, and a wiped etcd gets every member back."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from membership_stores import ETCD, ETCDCTL, NO_ETCD, OPENSSL, EtcdCerts, EtcdProcess, free_port, wait_until

from bootstrap.membership import EtcdMembership, EtcdOptions, Member, Membership, make_membership

pytestmark = pytest.mark.skipif(ETCD is None or ETCDCTL is None, reason=NO_ETCD)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    server = EtcdProcess(tmp_path)
    server.start()
    yield server
    server.kill()


def _member(name: str) -> Member:
    return Member(f"{name}@127.0.0.1:8001", "decode", "127.0.0.1:8001", "decode", "http://127.0.0.1:9",
                  time.time_ns())


def _ids(membership: EtcdMembership) -> set[str]:
    return {m.instance_id for m in membership.view().members}


def test_etcd_auth_admits_the_right_password_and_names_the_missing_one(
        etcd: EtcdProcess, caplog: pytest.LogCaptureFixture) -> None:
    etcd.etcdctl("user", "add", "root:rootpw")
    etcd.etcdctl("auth", "enable")
    env = {"PD_ETCD_USER": "root", "PD_ETCD_PASSWORD": "rootpw"}
    member = make_membership(etcd.url, None, env)
    assert isinstance(member, EtcdMembership)
    member.announce(_member("d0"), ttl_s=2.0)
    member.start()
    anonymous = make_membership(etcd.url, None, {})
    wrong = make_membership(etcd.url, None, {"PD_ETCD_USER": "root", "PD_ETCD_PASSWORD": "nope"})
    assert anonymous is not None and wrong is not None
    try:
        wait_until(lambda: _ids(member) == {"d0@127.0.0.1:8001"} and member.view().fresh, 5.0,
                   "announced and seen with the right password")
        assert "d0" in etcd.etcdctl("get", "--prefix", "/triton-pd/members/", user="root:rootpw")
        with caplog.at_level(logging.WARNING, logger="bootstrap.membership.etcd"):
            anonymous.announce(_member("intruder"), ttl_s=2.0)
            anonymous.start()
            wrong.start()
            wait_until(lambda: "user name is empty (etcd has auth enabled: set PD_ETCD_USER and "
                               "PD_ETCD_PASSWORD)" in caplog.text, 5.0, "the anonymous client told why")
            wait_until(lambda: "authentication failed, invalid user ID or password" in caplog.text, 5.0,
                       "the wrong password told why")
        assert not anonymous.view().fresh and not wrong.view().fresh
        assert _ids(member) == {"d0@127.0.0.1:8001"}, "the anonymous announce did not get in"
        etcd.kill()     # a restarted etcd forgets its simple tokens: the client must log in again
        etcd.start()
        wait_until(lambda: member.view().fresh and _ids(member) == {"d0@127.0.0.1:8001"}, 8.0,
                   "logged in again after etcd's restart")
        member.announce(_member("d1"), ttl_s=2.0)
        wait_until(lambda: _ids(member) == {"d0@127.0.0.1:8001", "d1@127.0.0.1:8001"}, 5.0,
                   "a put with the new token")
    finally:
        for m in (member, anonymous, wrong):
            m.stop()


@pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed")
def test_etcd_with_tls_client_certificates_and_auth(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", requests.certs.where())   # must not replace PD_ETCD_CA
    certs = EtcdCerts.make(tmp_path / "certs")
    etcd = EtcdProcess(tmp_path, certs)
    etcd.start()
    tls = {"PD_ETCD_CA": str(certs.ca), "PD_ETCD_CERT": str(certs.client_cert),
           "PD_ETCD_KEY": str(certs.client_key)}
    login = {"PD_ETCD_USER": "fleet", "PD_ETCD_PASSWORD": "fleetpw"}
    clients: list[Membership] = []
    try:   # docs/membership.md's commands: a root user, and a fleet user that may write the members only
        etcd.etcdctl("user", "add", "root:rootpw")
        etcd.etcdctl("user", "add", "fleet:fleetpw")
        etcd.etcdctl("role", "add", "fleet")
        etcd.etcdctl("role", "grant-permission", "fleet", "--prefix=true", "readwrite", "/triton-pd/members/")
        etcd.etcdctl("user", "grant-role", "fleet", "fleet")
        etcd.etcdctl("auth", "enable")
        named = {**tls, **login, "PD_ETCD_CERT": str(certs.server_cert), "PD_ETCD_KEY": str(certs.server_key)}
        envs = ({**tls, **login}, {"PD_ETCD_CA": str(certs.ca), **login}, tls, named)
        member, no_cert, no_user, with_cn = (make_membership(etcd.url, b"fleet", env) for env in envs)
        assert member is not None and no_cert is not None and no_user is not None and with_cn is not None
        clients = [member, no_cert, no_user, with_cn]
        member.announce(_member("d0"), ttl_s=2.0)
        no_user.announce(_member("intruder"), ttl_s=2.0)
        with caplog.at_level(logging.WARNING, logger="bootstrap.membership.etcd"):
            for client in clients:
                client.start()
            wait_until(lambda: member.view().fresh and _ids(member) == {"d0@127.0.0.1:8001"}, 5.0,
                       "announced and watched over TLS with a certificate and a password")
            wait_until(lambda: "SSL" in caplog.text and "user name is empty" in caplog.text, 5.0,
                       "the client without a certificate and the one without a user told why")
            wait_until(lambda: "PD_ETCD_CERT must be a certificate without a common name" in caplog.text, 5.0,
                       "a certificate with a common name told why etcd's gateway refuses it")
        assert not no_cert.view().fresh and not no_user.view().fresh and not with_cn.view().fresh
        assert _ids(member) == {"d0@127.0.0.1:8001"}, "the write without a user did not get in"
        member.stop(2.0)   # revokes its lease: the fleet user may, holding write on the members' prefix
        assert etcd.etcdctl("get", "--prefix", "/triton-pd/members/", user="root:rootpw") == ""
        with pytest.raises(requests.ConnectionError):   # plaintext on the TLS port
            requests.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": "Lw=="}, timeout=2)
    finally:
        for client in clients:
            client.stop(2.0)
        etcd.kill()


def test_a_lost_lease_is_granted_again(etcd: EtcdProcess) -> None:
    worker = EtcdMembership(EtcdOptions((etcd.endpoint,)))
    worker.announce(_member("d1"), ttl_s=3.0)
    worker.start()
    try:
        wait_until(lambda: _ids(worker) == {"d1@127.0.0.1:8001"}, 5.0, "registered")
        for line in etcd.etcdctl("lease", "list").splitlines()[1:]:
            etcd.etcdctl("lease", "revoke", line.strip())      # as if it expired: its key goes with it
        wait_until(lambda: _ids(worker) == set(), 2.0, "the key went with its lease")
        wait_until(lambda: _ids(worker) == {"d1@127.0.0.1:8001"}, 3.0, "re-granted and put again")
    finally:
        worker.stop()
    assert etcd.etcdctl("get", "--prefix", "/triton-pd/members/") == "", "stop() revoked the lease"


def test_a_wiped_etcd_gets_every_member_back(etcd: EtcdProcess, tmp_path: Path) -> None:
    workers = [EtcdMembership(EtcdOptions((etcd.endpoint,))) for _ in range(2)]
    for i, worker in enumerate(workers):
        worker.announce(_member(f"w{i}"), ttl_s=2.0)
        worker.start()
    want = {"w0@127.0.0.1:8001", "w1@127.0.0.1:8001"}
    try:
        wait_until(lambda: all(_ids(w) == want for w in workers), 5.0, "both registered")
        etcd.kill()
        shutil.rmtree(tmp_path / "etcd-data")
        etcd.start()
        wait_until(lambda: all(_ids(w) == want and w.view().fresh for w in workers), 8.0,
                   "both re-registered in the empty etcd, views fresh")
    finally:
        for worker in workers:
            worker.stop()


def test_a_dead_endpoint_is_skipped_for_the_next_one(etcd: EtcdProcess) -> None:
    dead = f"127.0.0.1:{free_port()}"
    worker = EtcdMembership(EtcdOptions((dead, etcd.endpoint)))
    worker.announce(_member("d2"), ttl_s=2.0)
    worker.start()
    try:
        wait_until(lambda: worker.view().fresh and _ids(worker) == {"d2@127.0.0.1:8001"}, 5.0,
                   "announced and watched through the second endpoint")
    finally:
        worker.stop()
