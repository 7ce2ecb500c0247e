"""``PeerTable.check_alive``: a peer whose rendezvous does not answer is lost only after ``peer_lost_s`` of
continuous silence; a refused connection loses it at once; and a silence that ended unseen (no check while
the peer had no open rooms) does not count into the next one. Fakes for the rendezvous client and the
transport."""

from __future__ import annotations

from typing import Any

import pytest

from bootstrap.errors import BootstrapError, RendezvousRefused
from kv_transfer.peers import Peer, PeerTable

PEER = "decode@h:1"


class Answers:
    """A rendezvous client whose ``get_instance`` plays ``script`` (an exception, or a registration)."""

    def __init__(self) -> None:
        self.script: list[Any] = []

    def get(self, url: str) -> Answers:
        return self

    def get_instance(self, instance_id: str) -> Any:
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class Registration:
    agent_name = "agent#1"


class Transport:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_peer(self, agent_name: str) -> None:
        self.removed.append(agent_name)


def table(answers: Answers) -> PeerTable:
    peers = PeerTable(answers, Transport(), "model", None,   # type: ignore[arg-type]
                      peer_lost_s=15.0, silence_gap_s=5.0)
    peers._peers[PEER] = Peer(PEER, "agent#1", 1, None, "http://h:2")   # type: ignore[arg-type]
    return peers


def test_silence_is_waited_out_up_to_peer_lost_s_then_the_peer_is_lost() -> None:
    answers = Answers()
    peers = table(answers)
    answers.script = [BootstrapError("timed out")] * 6
    for now_s in (0.0, 3.0, 6.0, 9.0, 12.0):
        with pytest.raises(BootstrapError):
            peers.check_alive(PEER, now_s)
    assert peers.check_alive(PEER, 15.5) is False and peers.get(PEER) is None


def test_a_refused_connection_loses_the_peer_at_once() -> None:
    answers = Answers()
    peers = table(answers)
    answers.script = [RendezvousRefused("connection refused")]
    assert peers.check_alive(PEER, 0.0) is False


def test_a_silence_that_ended_unseen_does_not_count_into_the_next() -> None:
    """A check timed out at t=0 (a blip, over before the next check); the peer had no room to check for 20 s;
    a check timing out at t=20 starts a new silence instead of losing a peer silent since t=0."""
    answers = Answers()
    peers = table(answers)
    answers.script = [BootstrapError("timed out"), BootstrapError("timed out"), Registration()]
    with pytest.raises(BootstrapError):
        peers.check_alive(PEER, 0.0)
    with pytest.raises(BootstrapError):
        peers.check_alive(PEER, 20.0)
    assert peers.check_alive(PEER, 21.0) is True


def test_a_sign_of_life_ends_the_silence() -> None:
    """A destination posted by the peer, a WRITE to it that landed, a notification from it: its rendezvous's
    silence so far no longer counts (two outages close together are two silences, not one long one)."""
    answers = Answers()
    peers = table(answers)
    answers.script = [BootstrapError("timed out"), BootstrapError("timed out"), BootstrapError("timed out")]
    with pytest.raises(BootstrapError):
        peers.check_alive(PEER, 0.0)
    peers.heard_from(PEER)
    with pytest.raises(BootstrapError):
        peers.check_alive(PEER, 3.0)
    with pytest.raises(BootstrapError):   # 15 s after the first silence began, 12 s into the second
        peers.check_alive(PEER, 15.0)
