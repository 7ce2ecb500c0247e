"""Wire messages (versioned envelopes) and one instance's own rendezvous server with its client, on port 0."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from bootstrap import BootstrapClient, BootstrapError, Rendezvous, RendezvousConfig, RendezvousRefused
from bootstrap.messages import Destination, DestinationBatch, InstanceLoad, Registration, decode, encode


def test_messages_round_trip_through_the_envelope() -> None:
    registration = Registration("p0", "prefill", 3, "p0#3", Registration.encode_metadata(b"\x00\xffmeta"),
                                "h", "127.0.0.1:1", {"layout": {"page_size": 16}},
                                rendezvous_url="http://h:1")
    assert decode(encode(registration), Registration) == registration
    assert decode(encode(registration), Registration).agent_metadata == b"\x00\xffmeta"
    batch = DestinationBatch([Destination(1, "p0", "d0", "d0#1", "x", [3, 4], 2, 0, "http://d:2")])
    assert decode(encode(batch), DestinationBatch) == batch


@pytest.mark.parametrize("change", [{"version": 3}, {"schema": "other"}, {"type": "Heartbeat"}])
def test_a_mismatched_envelope_is_refused(change: dict) -> None:  # type: ignore[type-arg]
    envelope = json.loads(encode(Destination(1, "p0", "d0", "a", "x", [1], 0)))
    envelope.update(change)
    with pytest.raises(BootstrapError):
        decode(json.dumps(envelope), Destination)


def test_a_load_report_of_protocol_8_is_refused_naming_both_versions() -> None:
    """Version 9 added each DP rank's queued prompt tokens to ``InstanceLoad``; a version-8 peer's message
    (without them) is refused by its version, not misread as a load with no queued tokens per rank."""
    load = InstanceLoad(num_queued_prompt_tokens=7, rank_free_pages=[3, 4], rank_queued_prompt_tokens=[7, 0])
    assert decode(encode(load), InstanceLoad) == load
    envelope = json.loads(encode(load))
    envelope["version"] = 8
    del envelope["body"]["rank_queued_prompt_tokens"]
    with pytest.raises(BootstrapError, match="peer speaks version 8 .* we speak 9"):
        decode(json.dumps(envelope), InstanceLoad)


@pytest.fixture
def prefill_rendezvous() -> Iterator[tuple[Rendezvous, threading.Event]]:
    woken = threading.Event()
    rendezvous = Rendezvous(RendezvousConfig(port=0), on_destination=woken.set)
    assert rendezvous.start() > 0
    rendezvous.register(Registration("p0", "prefill", 1, "p0#1", "", "h", rendezvous_url=rendezvous.url))
    yield rendezvous, woken
    rendezvous.stop()


def test_a_prefill_rendezvous_takes_rooms_and_wakes_its_owner(
        prefill_rendezvous: tuple[Rendezvous, threading.Event]) -> None:
    """Decode posts to prefill's own rendezvous; the owner is woken and takes the destination in-process,
    once; a second post of the room is refused; decode's release says prefill had it."""
    rendezvous, woken = prefill_rendezvous
    client = BootstrapClient(rendezvous.url, timeout_s=2.0)
    assert client.get_instance("p0").agent_name == "p0#1"  # type: ignore[union-attr]
    assert client.get_instance("d0") is None   # a rendezvous knows only its own instance
    first = client.post_destination(Destination(7, "p0", "d0", "d0#1", "x", [1], 0, 0, "http://d0:1"))
    assert first.accepted and first.prefill_agent_name == "p0#1" and woken.is_set()
    assert not client.post_destination(Destination(7, "p0", "d0", "d0#1", "y", [2], 1)).accepted
    assert [d.decode_rendezvous_url for d in rendezvous.take_destinations("p0")] == ["http://d0:1"]
    assert rendezvous.take_destinations("p0") == []
    assert client.release_room(7, "d0").delivered
    client.close()


def test_the_listing_is_the_instance_with_its_latest_load(
        prefill_rendezvous: tuple[Rendezvous, threading.Event]) -> None:
    rendezvous, _ = prefill_rendezvous
    load = InstanceLoad(num_queued_requests=2, num_free_pages=3, num_total_pages=4, page_size=16)
    assert rendezvous.report_load("p0", 1, load) and not rendezvous.report_load("p0", 2, load)
    client = BootstrapClient(rendezvous.url, timeout_s=2.0)
    [status] = client.list_instances()
    assert status.instance_id == "p0" and status.load == load and status.rendezvous_url == rendezvous.url
    client.close()


def test_a_stopped_rendezvous_is_refused_and_a_silent_one_times_out() -> None:
    """Refused (nothing listens: the process is gone) and a timeout (a peer that does not answer) are told
    apart: the first is ``RendezvousRefused``, the second a plain ``BootstrapError``."""
    rendezvous = Rendezvous(RendezvousConfig(port=0))
    rendezvous.start()
    url = rendezvous.url
    rendezvous.stop()
    with pytest.raises(RendezvousRefused):
        BootstrapClient(url, timeout_s=1.0).get_instance("p0")
    with socket.socket() as silent:   # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with pytest.raises(BootstrapError) as raised:
            BootstrapClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3).get_instance("p0")
        assert not isinstance(raised.value, RendezvousRefused)


def test_a_non_loopback_bind_needs_the_fleet_secret() -> None:
    with pytest.raises(BootstrapError, match="PD_FLEET_SECRET"):
        Rendezvous(RendezvousConfig(host="0.0.0.0", port=0)).start()


def test_without_the_fleet_secret_no_caller_can_post_release_or_read_a_room() -> None:
    """A rendezvous with a fleet secret refuses every unsigned (or wrongly signed) call with HTTP 401 naming
    the reason: nobody outside the fleet can point a prefill instance's KV at its own memory, release another
    decode's room or read the registration; the fleet's own signed calls work."""
    secret = b"fleet-secret"
    rendezvous = Rendezvous(RendezvousConfig(host="0.0.0.0", port=0, advertise_host="127.0.0.1",
                                             secret=secret))
    rendezvous.start()
    rendezvous.register(Registration("p0", "prefill", 1, "p0#1", "", "h", rendezvous_url=rendezvous.url))
    try:
        for client in (BootstrapClient(rendezvous.url, 2.0), BootstrapClient(rendezvous.url, 2.0, b"wrong")):
            with pytest.raises(BootstrapError, match="401"):
                client.post_destination(Destination(9, "p0", "evil", "evil#1", "x", [1], 0, 0,
                                                    "http://evil:1"))
            with pytest.raises(BootstrapError, match="401"):
                client.release_room(9, "d0")
            with pytest.raises(BootstrapError, match="401"):
                client.get_instance("p0")
            client.close()
        assert rendezvous.take_destinations("p0") == []
        fleet = BootstrapClient(rendezvous.url, 2.0, secret)
        assert fleet.post_destination(Destination(9, "p0", "d0", "d0#1", "x", [1], 0, 0,
                                                  "http://d0:1")).accepted
        assert fleet.release_room(9, "d0").known
        fleet.close()
    finally:
        rendezvous.stop()


def _secured(secret: bytes, instance_id: str) -> Rendezvous:
    rendezvous = Rendezvous(RendezvousConfig(host="127.0.0.1", port=0, secret=secret))
    rendezvous.start()
    rendezvous.register(Registration(instance_id, "prefill", 1, f"{instance_id}#1", "", "h",
                                     rendezvous_url=rendezvous.url))
    return rendezvous


def test_a_signed_call_replayed_to_another_instance_is_refused() -> None:
    """A read-only GET signed for instance A (captured on the wire), sent to instance B within its 30 s with
    either Host header: 401 (another server's signature); the same call signed for B works."""
    import requests

    from bootstrap.auth import AUTH_HEADER, HmacAuth

    secret = b"fleet-secret"
    a, b = _secured(secret, "p0"), _secured(secret, "p1")
    try:
        sent = requests.get(f"{a.url}/v1/instances", auth=HmacAuth(secret), timeout=5)
        assert sent.status_code == 200
        captured = {AUTH_HEADER: sent.request.headers[AUTH_HEADER]}
        for headers in (captured, {**captured, "Host": sent.request.headers["Host"]}):
            replay = requests.get(f"{b.url}/v1/instances", headers=headers, timeout=5)
            assert replay.status_code == 401, replay.text
        assert requests.get(f"{b.url}/v1/instances", auth=HmacAuth(secret), timeout=5).status_code == 200
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/rooms", b"[1, 2]"), ("/v1/rooms", b"null"), ("/v1/rooms", b'"text"'), ("/v1/rooms", b"\xff\xfe"),
    ("/v1/rooms", b"[" * 100_000), ("/v1/rooms/release", b"[]"), ("/v1/rooms/release", b"{}"),
])
def test_hostile_bodies_are_a_400_before_and_after_authentication(path: str, body: bytes) -> None:
    """Bodies that are not an envelope object: 401 unsigned, 400 signed (never a 500)."""
    import requests

    from bootstrap.auth import HmacAuth

    secret = b"fleet-secret"
    rendezvous = _secured(secret, "p0")
    try:
        assert requests.post(rendezvous.url + path, data=body, timeout=5).status_code == 401
        signed = requests.post(rendezvous.url + path, data=body, auth=HmacAuth(secret), timeout=5)
        assert signed.status_code == 400, signed.text
    finally:
        rendezvous.stop()


@pytest.mark.parametrize("field, value, reason", [
    ("room", [7], "room must be int"), ("dst_page_ids", "1,2,3", "dst_page_ids must be a list"),
    ("dst_page_ids", list(range(100_000)), "more than 65536"), ("dst_page_ids", [1, -2], "non-negative"),
    ("dst_page_ids", [1, "2"], "dst_page_ids must be int"), ("aux_slot", True, "aux_slot must be int"),
    ("decode_instance_id", None, "decode_instance_id must be str"), ("extra", 1, "unknown fields"),
])
def test_a_signed_destination_of_the_wrong_shape_is_refused_with_400(field: str, value: object,
                                                                     reason: str) -> None:
    import requests

    from bootstrap.auth import HmacAuth

    secret = b"fleet-secret"
    rendezvous = _secured(secret, "p0")
    try:
        envelope = json.loads(encode(Destination(9, "p0", "d0", "d0#1", "x", [1], 0, 0, "http://d0:1")))
        envelope["body"][field] = value
        response = requests.post(rendezvous.url + "/v1/rooms", data=json.dumps(envelope).encode(),
                                 auth=HmacAuth(secret), timeout=5)
        assert response.status_code == 400 and reason in response.text, response.text
        assert rendezvous.take_destinations("p0") == []
    finally:
        rendezvous.stop()
