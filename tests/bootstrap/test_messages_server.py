"""Wire messages (versioned envelopes) and the HTTP service with its client, on port 0."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from bootstrap import BootstrapClient, BootstrapError, BootstrapServer, RegistryConfig, ServerConfig
from bootstrap.__main__ import parse_config
from bootstrap.messages import AbortLog, Destination, DestinationBatch, InstanceLoad, Registration, decode, encode


def test_messages_round_trip_through_the_envelope() -> None:
    registration = Registration("p0", "prefill", 3, "p0#3", Registration.encode_metadata(b"\x00\xffmeta"),
                                "h", "127.0.0.1:1", {"layout": {"page_size": 16}})
    assert decode(encode(registration), Registration) == registration
    assert decode(encode(registration), Registration).agent_metadata == b"\x00\xffmeta"
    batch = DestinationBatch([Destination(1, "p0", "d0", "d0#1", "x", [3, 4], 2)])
    assert decode(encode(batch), DestinationBatch) == batch


@pytest.mark.parametrize("change", [{"version": 99}, {"schema": "other"}, {"type": "Heartbeat"}])
def test_a_mismatched_envelope_is_refused(change: dict) -> None:  # type: ignore[type-arg]
    envelope = json.loads(encode(Destination(1, "p0", "d0", "a", "x", [1], 0)))
    envelope.update(change)
    with pytest.raises(BootstrapError):
        decode(json.dumps(envelope), Destination)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(ServerConfig(port=0, expire_interval_s=0.05,
                                       registry=RegistryConfig(registration_ttl_s=0.3)))
    assert srv.start() > 0
    yield srv
    srv.stop()


def test_service_round_trip(server: BootstrapServer) -> None:
    client = BootstrapClient(server.url, timeout_s=2.0)
    client.register(Registration("p0", "prefill", 1, "p0#1", "", "h"))
    client.register(Registration("d0", "decode", 1, "d0#1", "", "h"))
    assert client.get_instance("p0").agent_name == "p0#1"  # type: ignore[union-attr]
    assert client.get_instance("nope") is None
    first = client.post_destination(Destination(7, "p0", "d0", "d0#1", "x", [1], 0))
    assert first.accepted and first.prefill_agent_name == "p0#1"
    assert not client.post_destination(Destination(7, "p0", "d0", "d0#1", "y", [2], 1)).accepted
    assert [d.room for d in client.take_destinations("p0")] == [7]
    assert client.release_room(7, "d0").delivered
    assert client.heartbeat("p0", 1) and not client.heartbeat("p0", 2)
    client.abort_room(7, "client went away")
    log = client.aborted_rooms()
    assert log.rooms == [7] and client.aborted_rooms(log.last_seq) == AbortLog([], log.last_seq)
    client.register(Registration("r0", "router", 1, "", "", "", address="127.0.0.1:8001", model_name="pd"))
    load = InstanceLoad(num_free_pages=3, num_total_pages=4, page_size=16)
    assert client.heartbeat("d0", 1, load)
    fleet = {s.instance_id: s for s in client.list_instances()}
    assert set(fleet) == {"p0", "d0", "r0"} and fleet["d0"].load == load and fleet["r0"].model_name == "pd"
    assert [s.instance_id for s in client.list_instances("router")] == ["r0"]
    client.deregister("r0", 1)
    assert client.aborted_rooms(log.last_seq).routers == ["r0"]


def test_registrations_expire_on_idle_ticks(server: BootstrapServer) -> None:
    client = BootstrapClient(server.url, timeout_s=2.0)
    client.register(Registration("p0", "prefill", 1, "p0#1", "", "h"))
    time.sleep(0.6)  # no request in between: the idle timer must expire it
    assert server.registry.num_instances == 0


def test_client_calls_time_out_with_a_typed_error() -> None:
    with pytest.raises(BootstrapError):
        BootstrapClient("http://127.0.0.1:9", timeout_s=0.5).get_instance("p0")


def test_cli_builds_the_config() -> None:
    config = parse_config(["--host", "127.0.0.1", "--port", "0", "--registration-ttl-s", "3"])
    assert config.port == 0 and config.registry.registration_ttl_s == 3.0


def test_abort_log_long_poll_answers_when_a_room_is_aborted(server: BootstrapServer) -> None:
    """``aborted_rooms(cursor, wait_s)``: held while nothing is aborted, answered as soon as a room is; a bad
    ``wait_s`` is a 400 (``BootstrapError``)."""
    import threading

    client, poster = BootstrapClient(server.url, timeout_s=2.0), BootstrapClient(server.url, timeout_s=2.0)
    cursor = client.aborted_rooms().last_seq
    started = time.monotonic()
    assert client.aborted_rooms(cursor, wait_s=0.3) == AbortLog([], cursor)   # nothing: held for the wait
    assert time.monotonic() - started >= 0.3
    timer = threading.Timer(0.2, poster.abort_room, args=(21, "client went away"))
    timer.start()
    started = time.monotonic()
    log = client.aborted_rooms(cursor, wait_s=10.0)
    assert log.rooms == [21] and log.last_seq == cursor + 1 and time.monotonic() - started < 5.0
    timer.join()
    with pytest.raises(BootstrapError, match="400"):
        client._call("GET", "/v1/aborts?after=-1&wait_s=soon", None, DestinationBatch)


def test_stopping_the_service_answers_held_long_polls() -> None:
    import threading

    srv = BootstrapServer(ServerConfig(port=0))
    srv.start()
    client = BootstrapClient(srv.url, timeout_s=2.0)
    answers: list[object] = []
    poller = threading.Thread(target=lambda: answers.append(client.aborted_rooms(-1, wait_s=20.0)))
    poller.start()
    time.sleep(0.3)
    started = time.monotonic()
    srv.stop()
    poller.join(10)
    assert answers == [AbortLog([], -1)] and time.monotonic() - started < 3.0
