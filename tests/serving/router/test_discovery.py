"""``LocalServerMembers`` (the router's own server's PD workers) while that server cannot be read."""

from __future__ import annotations

import logging
import socket

import pytest

from serving.router.discovery import LocalServerMembers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_still_starting_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """The router's model loads before tritonserver opens its gRPC port: every start refuses the first rounds
    (4 a second). Within ``STARTUP_GRACE_S`` that is logged at debug level only, the last view kept."""
    members = LocalServerMembers(f"127.0.0.1:{_closed_port()}", timeout_s=1.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="serving.router.discovery"):
            for _ in range(3):
                assert members.members() == ([], False)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert sum("not read" in r.getMessage() for r in caplog.records) == 3
    finally:
        members.close()


def test_an_unreadable_server_is_warned_about_once_not_every_round(caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the start-up grace (here 0 s), a server that cannot be read: one warning, the last view kept, and
    no more warnings while it stays unreadable (a plain tritonserver's start logged one per round until gRPC
    listened)."""
    monkeypatch.setattr("serving.router.discovery.STARTUP_GRACE_S", 0.0)
    members = LocalServerMembers(f"127.0.0.1:{_closed_port()}", timeout_s=1.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="serving.router.discovery"):
            for _ in range(3):
                assert members.members() == ([], False)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not read" in warnings[0].getMessage()
        assert sum("not read" in r.getMessage() for r in caplog.records) == 3   # the later ones at debug
    finally:
        members.close()
