"""A fleet server's admin surface, attacked from a process without the fleet secret (issue #44, attack 1).

With explicit model control, ``POST /v2/repository/models/<m>/load`` can carry a whole python model in its
parameters (``file:1/model.py``): whoever reaches an unrestricted HTTP or gRPC port runs code in the server.
The server here is the README's multi-host command for a router (``ROLE=router HOST=0.0.0.0`` with a fleet
secret; advertised on loopback, as one machine allows). The payload is a real python model whose
``initialize`` writes a marker file; a bare tritonserver without the restriction loads it and the marker
appears (the control: the payload is valid, so a refusal is the restriction's doing).

Invariants: without the admin key, or with a wrong one, every admin API (repository index, load with files,
model config, statistics, trace and log settings, shared memory) is refused over HTTP and gRPC and the marker
never appears; with ``pd-admin-key: <admin key>`` the repository index answers; health, metadata and
inference stay open; metrics listen on loopback only; a server reachable from other hosts without a secret
does not start.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from live_client import grpc_generate, make_inputs
from perf.server import REPO_ROOT, ServeScript, free_ports, supervised, tritonserver_paths, wait_ready
from tritonclient.utils import InferenceServerException

from bootstrap.auth import ADMIN_HEADER, admin_key
from serving.triton.admin_access import admin_headers

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.timeout(600)]
SECRET = b"admin-surface-test-secret"
READY_S = 180.0
STOP_S = 40.0
CLEAN_STOP_S = 15.0


def marker_model(name: str, marker: Path) -> tuple[str, dict[str, bytes]]:
    """(config JSON, files) of a python model ``name`` whose ``initialize`` writes ``marker``: what an
    attacker uploads with a load request."""
    config = {"name": name, "backend": "python", "max_batch_size": 0,
              "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
              "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}
    code = ("import pathlib\n\n\nclass TritonPythonModel:\n"
            "    def initialize(self, args):\n"
            f"        pathlib.Path({str(marker)!r}).write_text('code ran in the server')\n\n"
            "    def execute(self, requests):\n        return []\n")
    return json.dumps(config), {"file:1/model.py": code.encode()}


def http_load(http_url: str, name: str, marker: Path,
              headers: dict[str, str] | None = None) -> requests.Response:
    config, files = marker_model(name, marker)
    parameters = {"config": config, **{k: base64.b64encode(v).decode() for k, v in files.items()}}
    return requests.post(f"{http_url}/v2/repository/models/{name}/load", json={"parameters": parameters},
                         headers=headers or {}, timeout=120)


def grpc_refusal(call: object) -> str:
    """The error message of a gRPC call that must fail; raises AssertionError when it succeeds."""
    try:
        call()   # type: ignore[operator]
    except InferenceServerException as exc:
        return str(exc)
    raise AssertionError("the call succeeded")


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket of this machine listens on at ``port`` (``/proc/net/tcp``, LISTEN)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeScript]:
    env = {"ROLE": "router", "HOST": "0.0.0.0", "ADVERTISE_HOST": "127.0.0.1",
           "PD_FLEET_SECRET": SECRET.decode(), "PD_FLEET_SECRET_FILE": ""}
    server = ServeScript("pd_ensemble", tmp_path_factory.mktemp("admin") / "server.log", env=env)
    with supervised(server, READY_S, STOP_S, CLEAN_STOP_S):
        yield server


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """Where the uploaded model would write, had its code run."""
    return tmp_path / "marker"


def test_the_uploaded_model_runs_its_code_on_a_server_without_the_restriction(tmp_path: Path) -> None:
    """The control: the payload is a model tritonserver loads and runs (explicit model control, no
    restriction: what every server of the README's commands was before the restriction)."""
    binary, backends = tritonserver_paths()
    http, grpc, metrics = free_ports(3)
    (tmp_path / "repo").mkdir()
    argv = [str(binary), f"--model-repository={tmp_path / 'repo'}", f"--backend-directory={backends}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
            f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
            "--model-control-mode=explicit", "--exit-timeout-secs=5"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{http}", proc, READY_S, lambda: (tmp_path / "server.log").read_text())
        marker = tmp_path / "marker"
        resp = http_load(f"http://127.0.0.1:{http}", "uploaded", marker)
        assert resp.status_code == 200, resp.text
        assert marker.read_text() == "code ran in the server"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)   # the server and the uploaded model's stub
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_without_the_admin_key_every_admin_api_is_refused_and_no_code_runs(fleet_server: ServeScript,
                                                                         marker: Path) -> None:
    http = fleet_server.http_url
    wrong = {ADMIN_HEADER: admin_key(b"another secret")}
    name = f"uploaded_{uuid.uuid4().hex[:8]}"
    refused = {
        "index": requests.post(f"{http}/v2/repository/index", timeout=10),
        "index, wrong key": requests.post(f"{http}/v2/repository/index", headers=wrong, timeout=10),
        "index, the secret itself": requests.post(f"{http}/v2/repository/index",
                                                  headers={ADMIN_HEADER: SECRET.decode()}, timeout=10),
        "load with files": http_load(http, name, marker),
        "load with files, wrong key": http_load(http, name, marker, wrong),
        "unload": requests.post(f"{http}/v2/repository/models/pd_ensemble/unload", timeout=10),
        "model config": requests.get(f"{http}/v2/models/pd_ensemble/config", timeout=10),
        "statistics": requests.get(f"{http}/v2/models/stats", timeout=10),
        "trace settings": requests.post(f"{http}/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"]},
                                        timeout=10),
        "log settings": requests.post(f"{http}/v2/logging", json={"log_verbose_level": 1}, timeout=10),
        "shared memory": requests.get(f"{http}/v2/systemsharedmemory/status", timeout=10),
    }
    for what, resp in refused.items():
        assert resp.status_code == 403 and ADMIN_HEADER in resp.text, \
            f"{what}: {resp.status_code} {resp.text}"

    client = grpcclient.InferenceServerClient(fleet_server.grpc_url)
    config, files = marker_model(name, marker)
    wrong_grpc = admin_headers(b"another secret", grpc=True)
    errors = [grpc_refusal(lambda: client.get_model_repository_index()),
              grpc_refusal(lambda: client.get_model_repository_index(headers=admin_headers(SECRET))),
              grpc_refusal(lambda: client.load_model(name, config=config, files=files)),
              grpc_refusal(lambda: client.load_model(name, headers=wrong_grpc, config=config, files=files)),
              grpc_refusal(lambda: client.get_model_config("pd_ensemble")),
              grpc_refusal(lambda: client.get_inference_statistics()),
              grpc_refusal(lambda: client.update_log_settings({"log_verbose_level": 1})),
              grpc_refusal(lambda: client.get_system_shared_memory_status())]
    assert all(ADMIN_HEADER in e for e in errors), errors
    time.sleep(2.0)   # a load is synchronous; a stub that had been started would have written by now
    assert not marker.exists()
    index = client.get_model_repository_index(headers=admin_headers(SECRET, grpc=True), as_json=True)
    assert name not in {m["name"] for m in index.get("models", [])}
    assert client.is_model_ready("pd_ensemble")   # the refused unload left it loaded
    client.close()


def test_the_admin_key_opens_the_index_and_clients_keep_health_metadata_and_inference(
        fleet_server: ServeScript) -> None:
    http, key = fleet_server.http_url, {ADMIN_HEADER: admin_key(SECRET)}
    index = requests.post(f"{http}/v2/repository/index", headers=key, timeout=10)
    assert index.status_code == 200 and "pd_ensemble" in {m["name"] for m in index.json()}
    client = grpcclient.InferenceServerClient(fleet_server.grpc_url)
    index = client.get_model_repository_index(headers=admin_headers(SECRET, grpc=True), as_json=True)
    assert "pd_ensemble" in {m["name"] for m in index["models"]}
    for path in ("/v2/health/ready", "/v2", "/v2/models/pd_ensemble", "/v2/models/pd_ensemble/ready"):
        assert requests.get(f"{http}{path}", timeout=10).status_code == 200, path
    assert client.is_server_live() and client.get_model_metadata("pd_ensemble").name == "pd_ensemble"
    client.close()
    # inference is open: the router answers the request (a router alone: that it has no worker instance)
    result = grpc_generate(fleet_server.grpc_url, make_inputs("Hi", {"max_tokens": 2}), model="pd_ensemble")
    assert result.error is not None and "no healthy" in result.error, result


def test_metrics_listen_on_loopback_only_beside_a_public_bind(fleet_server: ServeScript) -> None:
    http_port, _, metrics_port, _ = fleet_server.ports
    assert listening_addresses(http_port) == {"0.0.0.0"}
    assert listening_addresses(metrics_port) == {"127.0.0.1"}


def test_a_server_other_hosts_reach_does_not_start_without_the_fleet_secret(tmp_path: Path) -> None:
    for role in ("router", "decode", "all"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PD_FLEET_SECRET")}
        env.update(ROLE=role, HOST="0.0.0.0", SKIP_SETUP="1", OPENAI="0")
        proc = subprocess.run([str(REPO_ROOT / "scripts" / "serve.sh")], env=env, capture_output=True,
                              text=True, timeout=60, cwd=REPO_ROOT)
        assert proc.returncode == 2, (role, proc.stdout, proc.stderr)
        assert "tritonserver binds 0.0.0.0, which other hosts reach: set PD_FLEET_SECRET" in proc.stderr
        assert "Started GRPCInferenceService" not in proc.stdout + proc.stderr
