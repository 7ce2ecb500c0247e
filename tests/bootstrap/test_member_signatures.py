"""Signed member records: a signature covers every field of a member and its version, only the fleet secret
makes one, ``MemberCheck`` (what every reader applies) refuses unsigned, foreign, altered, moved and replayed
older records, logging each (instance id, reason) once; without a secret nothing is signed or checked; the
registry refuses to store an unsigned member when it has the secret."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import requests

from bootstrap.auth import HmacAuth
from bootstrap.membership import MEMBER_VERSION, Member, MembershipError, MemberSignatureError, RegistryServer
from bootstrap.membership.base import MemberCheck

SECRET = b"fleet secret of the signature tests"
LOGGER = logging.getLogger("test.member_signatures")


def _member(epoch: int = 5, address: str = "10.0.0.3:8001") -> Member:
    return Member("decode@10.0.0.3:8001", "decode", address, "decode", "http://10.0.0.3:8999", epoch)


def test_the_signature_covers_every_field_and_only_the_secret_makes_it() -> None:
    signed = _member().signed(SECRET)
    assert len(signed.signature) == 64 and signed == _member(), "signing changes no content"
    signed.check(SECRET)
    assert Member.from_json(signed.to_json()).signature == signed.signature, "the JSON carries it"
    for name, value in [("instance_id", "decode@10.6.6.6:8001"), ("role", "prefill"),
                        ("address", "10.6.6.6:1"), ("model_name", "other"),
                        ("rendezvous_url", "http://10.6.6.6:2"), ("epoch", 6)]:
        altered = dataclasses.replace(signed, **{name: value})
        with pytest.raises(MemberSignatureError, match="bad member record signature"):
            altered.check(SECRET)
    with pytest.raises(MemberSignatureError, match="bad member record signature"):
        _member().signed(b"another fleet").check(SECRET)
    with pytest.raises(MemberSignatureError, match="unsigned member record"):
        _member().check(SECRET)
    assert _member().signed(None).signature == "", "without a secret nothing is signed"


def test_the_payload_is_the_sorted_json_without_the_signature_and_binds_the_version() -> None:
    payload = json.loads(_member().signed(SECRET).payload())
    assert "signature" not in payload and payload["version"] == MEMBER_VERSION
    assert list(payload) == sorted(payload)
    assert json.loads(_member().to_json())["signature"] == ""


def test_a_record_of_another_version_is_refused_with_both_versions_named() -> None:
    old = {k: v for k, v in _member().to_dict().items() if k != "signature"} | {"version": 1}
    with pytest.raises(MembershipError, match=f"member version 1 is not {MEMBER_VERSION} .version 2: signed"):
        Member.from_dict(old)


@pytest.mark.parametrize("fields", [{"address": ["10.6.6.6", 1]}, {"signature": 7}, {"model_name": None}])
def test_a_field_of_the_wrong_type_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(MembershipError, match="must be a string"):
        Member.from_dict({**_member().to_dict(), **fields})


def test_member_check_refuses_what_the_fleet_did_not_sign_and_logs_each_once(
        caplog: pytest.LogCaptureFixture) -> None:
    check = MemberCheck(SECRET, LOGGER, "etcd://store")
    genuine = _member(epoch=5).signed(SECRET)
    forged = _member(address="10.6.6.6:8001")
    key = "/triton-pd/members/" + genuine.instance_id
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert check.accept(genuine.to_json(), key, genuine.instance_id) == genuine
        for _ in range(3):
            assert check.accept(forged.to_json(), key, forged.instance_id) is None
        assert check.accept(forged.signed(b"another fleet").to_dict(), key, forged.instance_id) is None
        assert check.accept(genuine.to_json(), "/triton-pd/members/decode@x:1", "decode@x:1") is None
        assert check.accept(_member(epoch=4).signed(SECRET).to_json(), key, genuine.instance_id) is None
        assert check.accept("{not json", "/triton-pd/members/junk", "junk") is None
        assert check.accept(_member(epoch=6).signed(SECRET).to_json(), key, genuine.instance_id) is not None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, "one line per (instance id, reason), the repeated unsigned record once"
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert lines[0] == (f"ignoring the member record at {key} of etcd://store: unsigned member record "
                        "(no fleet signature)")
    assert "bad member record signature: wrong fleet secret" in lines[1]
    assert "/triton-pd/members/decode@x:1" in lines[2] and "is under the key of 'decode@x:1'" in lines[2]
    assert "epoch 4 is older than epoch 5 read before" in lines[3]
    assert "/triton-pd/members/junk" in lines[4] and "a member is not JSON" in lines[4]


def test_without_a_secret_nothing_is_checked_but_the_key_and_the_epoch() -> None:
    check = MemberCheck(None, LOGGER, "http://registry")
    assert check.sign(_member()).signature == ""
    assert check.accept(_member(epoch=5).to_dict(), "/v1/members/decode@10.0.0.3:8001") == _member(5)
    assert check.accept(_member(epoch=4).to_dict(), "/v1/members/decode@10.0.0.3:8001") is None
    assert check.accept(_member().to_json(), "/k/decode@x:1", "decode@x:1") is None


def test_a_registry_with_the_secret_refuses_to_store_an_unsigned_member() -> None:
    registry = RegistryServer("127.0.0.1", 0, SECRET, ttl_s=5.0)
    registry.start()
    try:
        with requests.Session() as session:
            session.auth = HmacAuth(SECRET)   # a fleet member's call, with a member it did not sign
            url = registry.url + "/v1/members/" + _member().instance_id
            for member, status in [(_member(), 403), (_member().signed(b"another fleet"), 403),
                                   (_member().signed(SECRET), 200)]:
                body = {"version": MEMBER_VERSION, "member": member.to_dict(), "ttl_s": 5}
                response = session.put(url, json=body, timeout=5)
                assert response.status_code == status, response.text
            assert [m.signature for m in registry.table.members(0.0)] == [_member().signed(SECRET).signature]
    finally:
        registry.stop()
