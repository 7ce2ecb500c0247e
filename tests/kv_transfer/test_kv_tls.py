"""KV managers with the fleet's TLS setting (``KVArgs.fleet_tls``, in-process backend): each instance's
rendezvous serves HTTPS and peers reach it so.

Invariants: both rendezvous URLs say ``https://``; a room moves every byte through them (decode posts its
destination to prefill's rendezvous, each side fetches the other's registration) with the fleet secret on
top; a decode instance that trusts another CA cannot reach prefill's rendezvous, and its room fails at once
naming the TLS failure (a setting to fix, not a peer to wait for).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from kv_harness import LocalSide, wait_for
from test_contract import assert_pages_back, transfer

from bootstrap.tls import FleetTLS, load_fleet_tls
from kv_transfer import KVPoll

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from perf.tls_certs import have_openssl, make_fleet_certs  # noqa: E402 - scripts/ is on sys.path (above)

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not have_openssl(), reason="the openssl command is not installed")]
SECRET = b"kv tls secret"


def _tls(directory: Path, ca_name: str = "ca") -> FleetTLS:
    tls = load_fleet_tls(make_fleet_certs(directory, ca_name=ca_name).env())
    assert tls is not None
    return tls


def _side(role: str, instance_id: str, tls: FleetTLS) -> Any:
    side = LocalSide(role, instance_id, "inprocess", fleet_secret=SECRET, fleet_tls=tls)
    side.start_free = side.call("start")
    side.rendezvous_url = side.call("rendezvous_url")
    return side


def test_a_room_moves_through_tls_rendezvous_and_another_ca_fails_it(tmp_path: Path) -> None:
    tls = _tls(tmp_path / "fleet")
    prefill, decode = _side("prefill", "prefill-tls", tls), _side("decode", "decode-tls", tls)
    stranger = _side("decode", "decode-other-ca", _tls(tmp_path / "other", "other"))
    try:
        assert prefill.rendezvous_url.startswith("https://") and decode.rendezvous_url.startswith("https://")
        transfer(prefill, decode, 40)
        stranger.call("open_receiver", 99, prefill.instance_id, prefill.rendezvous_url, 40)
        wait_for(lambda: stranger.call("poll", 99) == KVPoll.Failed, 10.0, "the other CA's room failed")
        failure = stranger.call("failure", 99)   # at once, not by its bootstrap timeout
        assert "unreachable: GET https://" in failure and "CERTIFICATE_VERIFY_FAILED" in failure, failure
        assert_pages_back(prefill, decode)
    finally:
        for side in (stranger, decode, prefill):
            side.call("stop")
