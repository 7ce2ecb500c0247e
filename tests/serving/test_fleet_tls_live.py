"""``pd_ensemble`` (1P1D) in a real tritonserver with ``PD_TLS_*`` set: the workers' rendezvous serve HTTPS,
their endpoints speak TLS, and the router and decode reach them with the fleet's CA.

Invariants: greedy text through the router equals the colocated engine's (the router polled both rendezvous
and streamed both children over TLS, decode posted its destination to prefill's rendezvous over TLS); each
worker's rendezvous URL says ``https://`` and answers ``/health`` to a client trusting the CA, nothing to a
plaintext one; each worker endpoint completes a TLS handshake for the CA and closes out plaintext child
frames.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Iterator

import pytest
import requests
from live_client import grpc_generate, make_inputs, streams_match_reference
from live_prompts import colocated_greedy_texts
from perf.server import ServeScript, supervised
from perf.tls_certs import FleetCerts, have_openssl, make_fleet_certs

from serving.child.frames import PREAMBLE

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600),
              pytest.mark.skipif(not have_openssl(), reason="the openssl command is not installed")]
GREEDY = {"max_tokens": "8", "temperature": "0"}
PROMPTS = ["The capital of France is", "Count: one, two, three,"]
#: what a model says when its python stub cannot import ssl (``bootstrap.tls.ssl_module``)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeScript, FleetCerts]]:
    pytest.importorskip("pytriton")
    certs = make_fleet_certs(tmp_path_factory.mktemp("fleet-ca"))
    server = ServeScript("pd_ensemble,prefill,decode", tmp_path_factory.mktemp("triton") / "server.log",
                         env=certs.env())
    with supervised(server, 240.0, 40.0, 15.0):   # a stub that cannot import ssl fails here: set-up's venv
        yield server, certs                        # must be the stub's interpreter (scripts/prereqs.py)


def test_pd_through_tls_rendezvous_and_endpoints_streams_the_colocated_text(
        tls_server: tuple[ServeScript, FleetCerts]) -> None:
    server, certs = tls_server
    reference = colocated_greedy_texts(PROMPTS, GREEDY)
    streams_match_reference(lambda p: grpc_generate(server.grpc_url, make_inputs(p, GREEDY),
                                                    model="pd_ensemble"), PROMPTS, reference)
    log = server.log_tail(400_000)
    rendezvous = sorted(set(re.findall(r"rendezvous (https?://127\.0\.0\.1:\d+)", log)))
    endpoints = sorted(set(re.findall(r"worker endpoint of \w+ at (127\.0\.0\.1:\d+)", log)))
    assert len(rendezvous) == 2 and all(url.startswith("https://") for url in rendezvous), rendezvous
    assert len(endpoints) == 2, endpoints
    for url in rendezvous:
        assert requests.get(url + "/health", verify=str(certs.ca_file), timeout=5).text == "ok"
        with pytest.raises(requests.ConnectionError):
            requests.get(url.replace("https://", "http://") + "/health", timeout=5)
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    for address in endpoints:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=host) as wrapped:
            assert wrapped.version() in ("TLSv1.2", "TLSv1.3")
        with socket.create_connection((host, int(port)), timeout=5) as plain:
            plain.sendall(PREAMBLE + b"\x00" * 64)   # child frames without TLS
            try:
                assert plain.recv(64) == b"", "a plaintext peer is closed out"
            except ConnectionResetError:
                pass   # closed out with a reset
