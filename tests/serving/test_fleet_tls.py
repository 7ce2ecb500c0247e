"""TLS of the worker endpoints and of the fleet settings (``bootstrap.tls``): a worker endpoint with the
fleet's certificate serves child streams from a router's ``EndpointLauncher`` that trusts the fleet's CA, and
no other.

Invariants: the TLS launcher reads exactly what the worker sent and one FINAL; a plaintext launcher, a
launcher trusting another CA and a TLS launcher dialing a plaintext endpoint each fail the call with
``ChildUnavailable`` (naming the TLS failure where there is one) and the worker never sees a request;
``PD_TLS_*`` reach the worker and router configs, and an ``http://`` registry is refused with them. The worker
is scripted (no tritonserver); certificates are made with the ``openssl`` command.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from perf.tls_certs import FleetCerts, have_openssl, make_fleet_certs

from bootstrap.tls import FleetTLS, load_fleet_tls
from serving.config import ConfigError, build_worker_config
from serving.delta import Delta, ResponseChunk
from serving.parsing.pd_request import PDRequest
from serving.router.config import build_router_config
from serving.router.fleet import Target
from serving.router.launch import ChildCall, ChildUnavailable, EndpointLauncher
from serving.stream import ResponseSink
from serving.workers.endpoint import WorkerEndpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not have_openssl(), reason="the openssl command is not installed")]


class TokenWorker:
    """Answers every request with ``t0 .. t4`` and a FINAL, from a thread of its own (as an engine loop
    does)."""

    def __init__(self) -> None:
        self.rooms: list[int] = []

    def handle(self, pd: PDRequest, sink: ResponseSink) -> str:
        self.rooms.append(pd.room)

        def answer() -> None:
            for i in range(5):
                sink.send(ResponseChunk.single(text=f"t{i} ", num_output_tokens=i + 1), final=False)
            sink.send(ResponseChunk.single(finish_reason="length", num_output_tokens=5), final=True)
        threading.Thread(target=answer, daemon=True).start()
        return str(pd.room)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> FleetCerts:
    return make_fleet_certs(tmp_path_factory.mktemp("fleet-ca"))


@pytest.fixture(scope="module")
def tls(certs: FleetCerts) -> FleetTLS:
    fleet_tls = load_fleet_tls(certs.env())
    assert fleet_tls is not None
    return fleet_tls


def _serve(tls: FleetTLS | None) -> tuple[WorkerEndpoint, TokenWorker]:
    worker = TokenWorker()
    endpoint = WorkerEndpoint("127.0.0.1", 0, "decode", fleet_tls=tls).bind()
    endpoint.start(worker)
    return endpoint, worker


@pytest.fixture
def tls_endpoint(tls: FleetTLS) -> Iterator[tuple[WorkerEndpoint, TokenWorker]]:
    endpoint, worker = _serve(tls)
    yield endpoint, worker
    endpoint.stop(1.0)


def _call(endpoint: WorkerEndpoint, room: int = 7) -> ChildCall:
    target = Target("decode@x", "decode", endpoint.address, "decode", worker_endpoint=True)
    return ChildCall("decode", target, room=room, prefill_instance="", prefill_rendezvous="",
                     inputs={"text_input": b"Hello", "sampling_parameters": b'{"max_tokens": 5}'})


def _stream(launcher: EndpointLauncher, call: ChildCall) -> list[Delta]:
    async def collect() -> list[Delta]:
        try:
            return [d async for d in launcher.stream(call)]
        finally:
            await launcher.close()
    return asyncio.run(collect())


def test_a_tls_endpoint_serves_a_tls_launchers_streams(tls_endpoint: tuple[WorkerEndpoint, TokenWorker],
                                                       tls: FleetTLS) -> None:
    endpoint, worker = tls_endpoint
    out = _stream(EndpointLauncher(tls=tls), _call(endpoint))
    assert "".join(d.text for d in out) == "t0 t1 t2 t3 t4 "
    assert [d.final for d in out].count(True) == 1 and out[-1].finish_reason == "length"
    assert worker.rooms == [7]


def test_a_plaintext_launcher_gets_nothing_from_a_tls_endpoint(
        tls_endpoint: tuple[WorkerEndpoint, TokenWorker]) -> None:
    endpoint, worker = tls_endpoint
    with pytest.raises(ChildUnavailable, match="before the stream's FINAL|connection failed"):
        _stream(EndpointLauncher(), _call(endpoint))
    assert worker.rooms == []


def test_a_launcher_trusting_another_ca_fails_the_handshake(tls_endpoint: tuple[WorkerEndpoint, TokenWorker],
                                                            tmp_path: Path) -> None:
    endpoint, worker = tls_endpoint
    other = make_fleet_certs(tmp_path, ca_name="other")
    stranger = FleetTLS(str(other.cert_file), str(other.key_file), str(other.ca_file))
    with pytest.raises(ChildUnavailable, match="unreachable: TLS handshake failed: .*CERTIFICATE_VERIFY"):
        _stream(EndpointLauncher(tls=stranger), _call(endpoint))
    assert worker.rooms == []


def test_a_tls_launcher_refuses_a_plaintext_endpoint(tls: FleetTLS) -> None:
    endpoint, worker = _serve(None)
    try:
        with pytest.raises(ChildUnavailable, match="unreachable: TLS handshake failed"):
            _stream(EndpointLauncher(tls=tls), _call(endpoint))
    finally:
        endpoint.stop(1.0)
    assert worker.rooms == []


def test_the_tls_variables_reach_both_configs_and_refuse_a_plaintext_registry(certs: FleetCerts,
                                                                               tls: FleetTLS) -> None:
    env = {**certs.env(), "PD_REGISTRY_URL": "https://registry:8998"}
    assert build_worker_config({}, environ=env).fleet_tls == tls
    assert build_router_config({}, environ=env).fleet_tls == tls
    assert build_worker_config({}, environ={}).fleet_tls is None
    with pytest.raises(ConfigError, match="'registry_url'.*plaintext .*while PD_TLS_\\* are set"):
        build_router_config({}, environ={**env, "PD_REGISTRY_URL": "http://registry:8998"})
    with pytest.raises(ConfigError, match="'PD_TLS_CERT'.*PD_TLS_KEY unset"):
        build_worker_config({}, environ={k: v for k, v in env.items() if k != "PD_TLS_KEY"})


def test_without_an_importable_ssl_a_plaintext_worker_and_router_still_load(certs: FleetCerts) -> None:
    """A python backend stub whose libpython differs from the environment's (this repository's pytriton
    stub) cannot import ``ssl``: plaintext must not need it, TLS must say why it cannot start."""
    script = (
        "import sys; sys.modules['ssl'] = None\n"
        "import serving.router.launch, serving.workers.endpoint, bootstrap.membership\n"
        "from serving.config import ConfigError, build_worker_config\n"
        "assert build_worker_config({}, environ={}).fleet_tls is None\n"
        f"env = {certs.env()!r}\n"
        "try:\n"
        "    build_worker_config({}, environ=env)\n"
        "except ConfigError as e:\n"
        "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot import its ssl module" in done.stdout
