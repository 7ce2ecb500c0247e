"""tritonserver's gRPC over TLS (``scripts/serve.sh`` with ``GRPC_SSL_*``), mutual, with a certificate made
here (``openssl``, self-signed, naming 127.0.0.1): one server with the router, prefill and decode
(``worker_endpoints`` false, so the router's child requests cross tritonserver's gRPC too), a fleet secret
(its admin APIs restricted) and the OpenAI front.

Invariants: a request through the front is served (front -> router over TLS; the router's read of its own
server's index over TLS with the admin key; child requests over TLS) with the text a direct TLS gRPC request
gets, and prefill and decode counted the children; a plaintext client, and a TLS client without a client
certificate, are refused.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from live_client import make_inputs
from perf.server import Deployment, ServeScript, build_model_repository, free_ports, supervised, wait_http_ok
from tritonclient.utils import InferenceServerException

from bootstrap.auth import ADMIN_HEADER, admin_key

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
SECRET = "grpc-tls-test-secret"
PROMPT = "The capital of France is"
READY_S = 300.0
STOP_S = 40.0
CLEAN_STOP_S = 15.0


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files: self-signed (its own CA), naming 127.0.0.1 and localhost."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


class TlsServer:
    def __init__(self, tmp: Path) -> None:
        self.cert, self.key = make_certificate(tmp)
        repository = build_model_repository(
            Deployment(name="tls", entry_model="pd_ensemble", models=("pd_ensemble", "prefill", "decode"),
                       overrides={"pd_ensemble": {"worker_endpoints": "false"}}), tmp / "models")
        self.openai_port = free_ports(1)[0]
        env = {"GRPC_SSL_CERT": str(self.cert), "GRPC_SSL_KEY": str(self.key),
               "GRPC_SSL_ROOT_CERT": str(self.cert), "GRPC_SSL_MUTUAL": "1", "PD_FLEET_SECRET": SECRET,
               "PD_FLEET_SECRET_FILE": "", "OPENAI": "1", "OPENAI_PORT": str(self.openai_port)}
        self.serve = ServeScript("pd_ensemble,prefill,decode", tmp / "server.log", repository, env=env)

    def client(self, tls: bool = True, client_cert: bool = True) -> grpcclient.InferenceServerClient:
        if not tls:
            return grpcclient.InferenceServerClient(self.serve.grpc_url)
        return grpcclient.InferenceServerClient(
            self.serve.grpc_url, ssl=True, root_certificates=str(self.cert),
            private_key=str(self.key) if client_cert else None,
            certificate_chain=str(self.cert) if client_cert else None)

    def executions(self, model: str) -> int:
        """Requests Triton ran through ``model`` (statistics: an admin API, read with the admin key)."""
        resp = requests.get(f"{self.serve.http_url}/v2/models/{model}/stats", timeout=10,
                            headers={ADMIN_HEADER: admin_key(SECRET.encode())})
        stats = resp.json()["model_stats"][0]["inference_stats"]
        return int(stats["success"]["count"]) + int(stats["fail"]["count"])


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    server = TlsServer(tmp_path_factory.mktemp("tls"))
    with supervised(server.serve, READY_S, STOP_S, CLEAN_STOP_S):
        assert server.serve._proc is not None
        wait_http_ok(f"http://127.0.0.1:{server.openai_port}/v1/models", server.serve._proc, 120,
                     lambda: f"serve.sh exited:\n{server.serve.log_tail()}",
                     lambda: f"the front did not answer:\n{server.serve.log_tail()}", poll_s=0.2)
        yield server


def grpc_text(client: grpcclient.InferenceServerClient, prompt: str, max_tokens: int) -> str:
    """The greedy text of one streamed request to pd_ensemble on ``client``."""
    texts: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def callback(result: object, error: object) -> None:
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        response = result.get_response()   # type: ignore[attr-defined]
        text = result.as_numpy("text_output")   # type: ignore[attr-defined]
        if text is not None:
            texts.append(b"".join(text.reshape(-1)).decode())
        if response.parameters["triton_final_response"].bool_param:
            done.set()

    client.start_stream(callback=callback)
    try:
        inputs = make_inputs(prompt, {"max_tokens": max_tokens, "temperature": 0})
        client.async_stream_infer("pd_ensemble", inputs, enable_empty_final_response=True)
        assert done.wait(120), "no FINAL within 120 s"
    finally:
        client.stop_stream()
    assert not errors, errors
    return "".join(texts)


def test_a_request_through_the_front_and_the_router_is_served_over_tls(tls_server: TlsServer) -> None:
    before = {m: tls_server.executions(m) for m in ("prefill", "decode")}
    resp = requests.post(f"http://127.0.0.1:{tls_server.openai_port}/v1/completions", timeout=120,
                         json={"model": "pd_ensemble", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    front_text = resp.json()["choices"][0]["text"]
    direct_text = grpc_text(tls_server.client(), PROMPT, 8)
    assert front_text and front_text == direct_text
    after = {m: tls_server.executions(m) for m in ("prefill", "decode")}
    assert all(after[m] - before[m] >= 2 for m in after), (before, after)   # children crossed gRPC (TLS)


def test_plaintext_and_clients_without_a_certificate_are_refused(tls_server: TlsServer) -> None:
    assert tls_server.client().is_server_live(client_timeout=10)
    for client in (tls_server.client(tls=False), tls_server.client(client_cert=False)):
        with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            client.is_server_live(client_timeout=10)
