"""The embedded registry's service and CLI: the fleet secret guards it (401 with the reason), a non-loopback
bind needs a secret, and a stale epoch is refused over HTTP."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from membership_stores import ROOT, child_env, wait_until

from bootstrap.auth import HmacAuth
from bootstrap.membership import MEMBER_VERSION, Member, RegistryMembership, RegistryServer

SECRET = b"registry secret"


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    server = RegistryServer("127.0.0.1", 0, SECRET, ttl_s=5.0)
    assert server.start() > 0
    yield server
    server.stop()


def _member(epoch: int) -> Member:
    return Member("router@127.0.0.1:8001/ab/cd", "router", "127.0.0.1:8001", "pd_ensemble", "", epoch)


def test_a_client_without_the_secret_is_refused_with_401_and_the_reason(
        registry: RegistryServer, caplog: pytest.LogCaptureFixture) -> None:
    response = requests.get(registry.url + "/v1/members", timeout=5)
    assert response.status_code == 401
    assert response.json()["error"] == ("missing X-PD-Fleet-Auth header: this fleet requires the fleet "
                                        "secret (PD_FLEET_SECRET)")
    assert requests.get(registry.url + "/health", timeout=5).text == "ok"
    outsider = RegistryMembership(registry.url, None)
    outsider.announce(Member("decode@10.0.0.9:1", "decode", "10.0.0.9:1", "m", "http://10.0.0.9:2", 1))
    with caplog.at_level(logging.WARNING, logger="bootstrap.membership.registry_client"):
        outsider.start()
        wait_until(lambda: "HTTP 401: missing X-PD-Fleet-Auth header" in caplog.text, 5.0,
                   "the refusal logged")
    outsider.stop()
    assert registry.table.members(time.monotonic()) == [], "an outsider cannot join"
    assert not outsider.view().fresh and outsider.view().members == ()


def test_ids_with_slashes_and_the_epoch_rule_over_http(registry: RegistryServer) -> None:
    newer, older = RegistryMembership(registry.url, SECRET), RegistryMembership(registry.url, SECRET)
    newer.announce(_member(epoch=20), ttl_s=5.0)
    newer.start()
    try:
        wait_until(lambda: newer.view().members == (_member(20),), 5.0, "the router registered")
        older.announce(_member(epoch=10), ttl_s=5.0)
        older.start()
        time.sleep(1.0)
        assert older.view().members == (_member(20),), "an older epoch never replaces a newer one"
        older.stop()
        assert registry.table.members(time.monotonic()) == [_member(20)], "nor does its stop() remove it"
    finally:
        newer.stop()
    assert registry.table.members(time.monotonic()) == [], "stop() withdraws at once"


def test_a_bad_registration_gets_400_with_the_reason(registry: RegistryServer) -> None:
    with requests.Session() as session:
        session.auth = HmacAuth(SECRET)
        body: dict[str, Any] = {"version": MEMBER_VERSION, "member": {**_member(1).to_dict(), "role": "boss"},
                                "ttl_s": 5}
        response = session.put(registry.url + "/v1/members/x", json=body, timeout=5)
        assert response.status_code == 400 and "role must be one of" in response.json()["error"]
        response = session.post(registry.url + "/v1/members/x/keepalive", timeout=5)
        assert response.status_code == 400 and "epoch=<int> is required" in response.json()["error"]


def test_the_cli_refuses_a_non_loopback_bind_without_a_secret() -> None:
    done = subprocess.run([sys.executable, "-m", "bootstrap.membership", "--host", "0.0.0.0", "--port", "0"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert ("the membership registry binds 0.0.0.0, which other hosts reach: set PD_FLEET_SECRET or "
            "PD_FLEET_SECRET_FILE") in done.stderr
