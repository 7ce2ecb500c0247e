"""Fixtures for tests across network hosts (``scripts/fleet/netns.py``): ``make_fleet`` makes fleets of
network namespaces and tears them down after the test, whatever its outcome; ``kv_pair`` starts a prefill and
a decode KV worker on two hosts of a fleet (each with its own rendezvous). Without root or iproute2 every test
that uses them skips with that reason."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))

from fleet.kv_worker import KVWorker  # noqa: E402
from fleet.netns import Fleet, unavailable_reason  # noqa: E402


@pytest.fixture(scope="module")
def fleet_kv_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str] | None:
    """The servers' extra environment for the KV backend ``PD_FLEET_KV_BACKEND`` names: ``nixl`` (the default,
    the model repository's own): none; ``mooncake``: a copy of the PD models with it as ``MODEL_REPOSITORY``.
    Skips the module where that backend is not installed."""
    import os

    from perf.server import pd_model_repository

    from kv_transfer import unavailable_reason as backend_unavailable

    backend = os.environ.get("PD_FLEET_KV_BACKEND", "nixl")
    assert backend in ("nixl", "mooncake"), f"PD_FLEET_KV_BACKEND={backend!r}: nixl or mooncake"
    reason = backend_unavailable(backend)
    if reason:
        pytest.skip(str(reason))
    if backend == "nixl":
        return None
    repository = pd_model_repository(tmp_path_factory.mktemp(f"{backend}-models"), backend)
    return {"MODEL_REPOSITORY": str(repository)}


@pytest.fixture
def make_fleet() -> Iterator[Callable[[Sequence[str]], Fleet]]:
    """``make_fleet(["a", "b"])`` -> a created ``Fleet``; every fleet made is torn down at the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    fleets: list[Fleet] = []

    def make(hosts: Sequence[str]) -> Fleet:
        fleet = Fleet(hosts)
        fleets.append(fleet)
        return fleet.create()

    yield make
    for fleet in fleets:
        fleet.teardown()


class KVPair:
    """A fleet ``reg``/``pf``/``dc``: a prefill KV worker on ``pf`` and a decode KV worker on ``dc``, each
    with its own rendezvous on its host's address (``reg`` hosts nothing since the rendezvous moved into the
    instances); ``stop`` stops both workers (the fleet's teardown stops the rest)."""

    def __init__(self, fleet: Fleet, backend: str, network_only: bool = True,
                 env: dict[str, str] | None = None, waiting_timeout_s: float = 30.0,
                 log_path: Path | None = None) -> None:
        self.fleet = fleet
        self.log = open(log_path, "w") if log_path else None   # noqa: SIM115 (closed by stop)
        self.prefill = KVWorker(fleet["pf"], "prefill", backend, network_only, env=env, log=self.log,
                                waiting_timeout_s=waiting_timeout_s)
        self.decode = KVWorker(fleet["dc"], "decode", backend, network_only, env=env, log=self.log,
                               waiting_timeout_s=waiting_timeout_s)

    def transfer(self, room: int, src: list[int], dst: list[int], timeout_s: float = 60.0) -> tuple[Any, Any]:
        """One room: decode publishes ``dst``, prefill sends ``src`` as one last chunk; returns the
        (prefill, decode) ``RoomResult``s."""
        self.decode.call("recv",
                         (room, dst, self.prefill.instance_id, self.prefill.rendezvous_url), timeout_s)
        self.decode.post("wait", (room, timeout_s))
        sent = self.prefill.call("send", (room, src, timeout_s, False), timeout_s + 15)
        return sent, self.decode.call_raw(timeout_s + 15)

    def stop(self) -> None:
        for worker in (self.prefill, self.decode):
            worker.stop()
        if self.log:
            self.log.close()


@pytest.fixture
def kv_pair(make_fleet: Callable[[Sequence[str]], Fleet], tmp_path: Path) -> Iterator[Callable[..., KVPair]]:
    """``kv_pair(backend, network_only=True, env=None)`` -> a started ``KVPair`` (workers' logs in
    ``tmp_path``); stopped at the end."""
    pairs: list[KVPair] = []

    def make(backend: str, network_only: bool = True, env: dict[str, str] | None = None,
             waiting_timeout_s: float = 30.0) -> KVPair:
        pytest.importorskip({"nixl": "nixl._api", "mooncake": "mooncake.engine"}[backend])
        pair = KVPair(make_fleet(["reg", "pf", "dc"]), backend, network_only, env, waiting_timeout_s,
                      tmp_path / f"workers-{len(pairs)}.log")
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.stop()
