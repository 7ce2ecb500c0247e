"""The admin restriction our launchers put on tritonserver, the header our callers send, and the gRPC TLS
settings (``serving.triton.admin_access``, ``serving.triton.grpc_tls``, ``serving.config.read_grpc_tls``, the
front's flags). Live behaviour: ``test_admin_surface_live.py``, ``test_grpc_tls_live.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bootstrap.auth import ADMIN_HEADER, AuthError, admin_key
from frontend.__main__ import parse_config
from frontend.backend import GrpcTlsFiles, TritonGrpcBackend
from frontend.config import FrontendConfig
from serving.config import ConfigError, read_grpc_tls
from serving.router.discovery import LocalServerMembers
from serving.triton.admin_access import ADMIN_APIS, admin_headers, main, restricted_api_args, server_args
from serving.triton.grpc_tls import GrpcTls, GrpcTlsError

SECRET = b"unit-test-fleet-secret"


def test_without_a_secret_nothing_is_restricted_and_no_header_is_sent() -> None:
    assert restricted_api_args(None) == [] and admin_headers(None) == {}


def test_the_restriction_covers_the_admin_apis_and_leaves_clients_theirs() -> None:
    http, grpc = restricted_api_args(SECRET)
    key = admin_key(SECRET)
    assert http == f"--http-restricted-api={','.join(ADMIN_APIS)}:{ADMIN_HEADER}={key}"
    assert grpc == f"--grpc-restricted-protocol={','.join(ADMIN_APIS)}:{ADMIN_HEADER}={key}"
    assert set(ADMIN_APIS) == {"model-repository", "model-config", "shared-memory", "statistics", "trace",
                               "logging"}
    assert not {"health", "metadata", "inference"} & set(ADMIN_APIS)
    assert SECRET.decode() not in http + grpc   # the command line (readable in /proc): a derived key only
    assert admin_headers(SECRET) == {ADMIN_HEADER: key}
    assert admin_headers(SECRET, grpc=True) == {f"triton-grpc-protocol-{ADMIN_HEADER}": key}


def test_a_public_bind_needs_a_secret_and_loopback_does_not() -> None:
    assert server_args("127.0.0.1", None) == []
    assert server_args("0.0.0.0", SECRET) == restricted_api_args(SECRET)
    assert server_args("127.0.0.1", SECRET) == restricted_api_args(SECRET)   # a secret always restricts
    for host in ("0.0.0.0", "10.0.0.2", "pd-router.example"):
        with pytest.raises(AuthError, match=f"tritonserver binds {host}, which other hosts reach"):
            server_args(host, None)


def test_the_command_line_prints_the_arguments_or_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server-args", "--host", "0.0.0.0"], {"PD_FLEET_SECRET": SECRET.decode()}) == 0
    assert capsys.readouterr().out.splitlines() == restricted_api_args(SECRET)
    assert main(["server-args", "--host", "127.0.0.1"], {}) == 0
    assert capsys.readouterr().out == ""
    assert main(["server-args", "--host", "0.0.0.0"], {}) == 2
    assert "refusing to start: tritonserver binds 0.0.0.0" in capsys.readouterr().err
    both = {"PD_FLEET_SECRET": "a", "PD_FLEET_SECRET_FILE": "/f"}
    assert main(["server-args", "--host", "127.0.0.1"], both) == 2
    assert "both PD_FLEET_SECRET and PD_FLEET_SECRET_FILE" in capsys.readouterr().err


class _IndexClient:
    """Records what the router sends to its server's repository index."""

    def __init__(self) -> None:
        self.headers: list[Any] = []

    def get_model_repository_index(self, headers: Any = None, **_: Any) -> dict[str, Any]:
        self.headers.append(headers)
        return {"models": []}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("secret", [SECRET, None])
def test_the_router_reads_its_servers_index_with_the_admin_key(secret: bytes | None) -> None:
    members = LocalServerMembers("127.0.0.1:1", fleet_secret=secret)
    client = members._client = _IndexClient()
    assert members.members() == ([], True)
    assert client.headers == [{f"triton-grpc-protocol-{ADMIN_HEADER}": admin_key(SECRET)} if secret else None]


def _pem(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    return str(path)


def test_grpc_tls_comes_from_the_environment_only_when_its_root_is_set(tmp_path: Path) -> None:
    root, cert, key = _pem(tmp_path, "ca.pem"), _pem(tmp_path, "c.pem"), _pem(tmp_path, "k.pem")
    assert read_grpc_tls({}) is None
    assert read_grpc_tls({"PD_GRPC_SSL_ROOT_CERT": root}) == GrpcTls(root)
    tls = read_grpc_tls({"PD_GRPC_SSL_ROOT_CERT": root, "PD_GRPC_SSL_CLIENT_CERT": cert,
                         "PD_GRPC_SSL_CLIENT_KEY": key, "PD_GRPC_SSL_TARGET_NAME": "pd.example"})
    assert tls == GrpcTls(root, cert, key, "pd.example")
    assert tls is not None and tls.channel_args() == [("grpc.ssl_target_name_override", "pd.example")]
    assert GrpcTls(root).channel_args() == []


@pytest.mark.parametrize("environ, reason", [
    ({"PD_GRPC_SSL_ROOT_CERT": "/nonexistent/ca.pem"}, "/nonexistent/ca.pem: cannot read it"),
    ({"PD_GRPC_SSL_ROOT_CERT": "ROOT", "PD_GRPC_SSL_CLIENT_CERT": "CERT"},
     "a client certificate needs its key"),
    ({"PD_GRPC_SSL_CLIENT_CERT": "CERT", "PD_GRPC_SSL_CLIENT_KEY": "KEY"}, "must be set when any other"),
])
def test_a_broken_grpc_tls_setting_is_refused_naming_it(tmp_path: Path, environ: dict[str, str],
                                                        reason: str) -> None:
    files = {"ROOT": _pem(tmp_path, "ca.pem"), "CERT": _pem(tmp_path, "c.pem"),
             "KEY": _pem(tmp_path, "k.pem")}
    environ = {k: files.get(v, v) for k, v in environ.items()}
    with pytest.raises(ConfigError, match="PD_GRPC_SSL_ROOT_CERT") as info:
        read_grpc_tls(environ)
    assert reason in str(info.value)
    with pytest.raises(GrpcTlsError):
        GrpcTls(files["ROOT"], client_key=files["KEY"])


def test_the_front_takes_its_grpc_tls_from_its_flags(tmp_path: Path) -> None:
    config, _ = parse_config(["--grpc-ssl-root-cert", "ca.pem", "--grpc-ssl-client-cert", "c.pem",
                              "--grpc-ssl-client-key", "k.pem", "--grpc-ssl-target-name", "pd.example"])
    assert (config.grpc_ssl_root_cert, config.grpc_ssl_client_cert, config.grpc_ssl_client_key,
            config.grpc_ssl_target_name) == ("ca.pem", "c.pem", "k.pem", "pd.example")
    with pytest.raises(ValueError, match="set both or neither"):
        FrontendConfig(grpc_ssl_root_cert="ca.pem", grpc_ssl_client_cert="c.pem")
    with pytest.raises(ValueError, match="need grpc_ssl_root_cert"):
        FrontendConfig(grpc_ssl_target_name="pd.example")
    plain = TritonGrpcBackend("127.0.0.1:1", "m")._tls_kwargs("keepalive")
    assert plain == {"keepalive_options": "keepalive"}
    files = GrpcTlsFiles("ca.pem", "c.pem", "k.pem")
    tls = TritonGrpcBackend("127.0.0.1:1", "m", tls=files)._tls_kwargs("ka")
    assert tls == {"keepalive_options": "ka", "ssl": True, "root_certificates": "ca.pem",
                   "private_key": "k.pem", "certificate_chain": "c.pem"}


def test_the_stub_guardian_gets_the_stubs_grpc_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guardian (its own process) checks the server over the same TLS as the stub's watches: the stub
    hands it over on its ``ready`` line once its model works, and a death after that is checked with it."""
    import os
    import subprocess
    import sys

    from serving.triton import stub_guard, stub_guardian

    root, cert, key = _pem(tmp_path, "ca.pem"), _pem(tmp_path, "c.pem"), _pem(tmp_path, "k.pem")
    tls = GrpcTls(root, cert, key, "pd.example")
    stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])   # a live stub of ours
    proc = _Proc()
    monkeypatch.setattr(stub_guard.subprocess, "Popen", lambda argv, **_: proc)
    guard = stub_guard.StubGuard("decode").start()
    guard.arm("127.0.0.1:1", tls)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, proc.stdin.getvalue())   # what the stub wrote, then its death: the pipe's end
    os.close(write_fd)
    built: list[GrpcTls | None] = []

    class Exiting:
        """The server's health as it answers while it stops."""

        def is_live(self) -> bool:
            raise ConnectionError("Server exiting")

        def is_model_ready(self, model: str) -> bool:
            return False

    def health(armed: stub_guardian.GuardedStub) -> Exiting:
        built.append(armed.tls)
        return Exiting()

    try:
        outcome = stub_guardian.guard(stub_guardian.GuardedStub("decode", "", os.getpid(), stub.pid), read_fd,
                                      make_health=health, end=lambda s: None)
    finally:
        os.close(read_fd)
        stub.kill()
        stub.wait(10)
    assert outcome == "server gone" and built == [tls]


class _Proc:
    """A started guardian process, as ``StubGuard`` sees it: its stdin is a buffer."""

    pid = 0

    def __init__(self) -> None:
        import io

        self.stdin = io.BytesIO()
