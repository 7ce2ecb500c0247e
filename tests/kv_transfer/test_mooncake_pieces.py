"""How the Mooncake transport cuts a write into pieces and when it gives a write up (pure functions; the
engine itself runs in test_contract.py, test_fence.py and the fleet tests)."""

from __future__ import annotations

import pytest

from kv_transfer import mooncake_transport as mc

MIB = 1 << 20


def test_one_long_run_goes_as_one_piece_per_connection() -> None:
    pieces = mc._pieces([1000], [5000], [180 * MIB], lanes=4)
    assert [n for _, _, n in pieces] == [45 * MIB] * 4
    assert [(s - 1000, d - 5000) for s, d, _ in pieces] == [(i * 45 * MIB, i * 45 * MIB) for i in range(4)]


def test_pieces_cover_every_byte_in_order_with_a_short_last_piece() -> None:
    pieces = mc._pieces([0, 10 * MIB], [0, 20 * MIB], [5 * MIB + 3, 64], lanes=4)
    assert pieces[-1] == (10 * MIB, 20 * MIB, 64)
    covered = [(s, s + n) for s, _, n in pieces[:-1]]
    assert covered[0][0] == 0 and covered[-1][1] == 5 * MIB + 3
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert all(s == d for s, d, _ in pieces[:-1])


def test_short_runs_are_not_cut() -> None:
    runs = [(i * MIB, i * MIB, 737_280) for i in range(8)]   # SmolLM2's fp32 pages, scattered
    assert mc._pieces(*map(list, zip(*runs)), lanes=4) == runs


def test_one_lane_sends_a_run_whole() -> None:
    assert mc._pieces([0], [0], [180 * MIB], lanes=1) == [(0, 0, 180 * MIB)]


def test_lanes_follow_the_engines_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_TCP_LANES_PER_PEER", raising=False)
    assert mc._lanes_per_peer() == 4
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "2")
    assert mc._lanes_per_peer() == 2
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "x")
    assert mc._lanes_per_peer() == 4


def test_a_writes_deadline_is_the_engines_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "10")
    assert mc._timeout_s(0) == 10
    assert mc._timeout_s(2 << 30) == pytest.approx(12.0)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    assert mc._timeout_s(0) == 5     # the binding reads at least 5 s
