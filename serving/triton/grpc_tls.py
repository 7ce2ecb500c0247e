"""``GrpcTls``: how our gRPC clients of tritonservers (the router's child channels, the control clients of
every process, the stub guardians) speak TLS to a fleet whose tritonservers run with ``--grpc-use-ssl``.

One setting per process, built once at its edge (``serving.config.read_grpc_tls``, from ``PD_GRPC_SSL_*``) and
passed down; None means plaintext, as before. A fleet is TLS everywhere or nowhere: a tritonserver's gRPC port
speaks one or the other, so every process that dials it must agree (``scripts/serve.sh`` exports the same
variables to every role; docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class GrpcTlsError(ValueError):
    """A TLS file is missing or unreadable, or a client certificate comes without its key; ``str()`` says
    which."""


@dataclass(frozen=True)
class GrpcTls:
    """Client-side TLS of gRPC channels to tritonservers.

    Attributes:
        root_cert: PEM file of the certificate authority that signed the servers' certificates.
        client_cert: PEM certificate chain this client presents (servers with ``--grpc-use-ssl-mutual``);
            empty: none.
        client_key: PEM private key of ``client_cert``; set exactly when ``client_cert`` is.
        target_name: the name servers' certificates are checked against instead of the dialed host (a fleet
            whose certificates name a DNS name while routers dial addresses); empty: the dialed host.

    Raises:
        GrpcTlsError: at construction, naming the file, when a file cannot be read or only one of
            ``client_cert`` / ``client_key`` is set.
    """

    root_cert: str
    client_cert: str = ""
    client_key: str = ""
    target_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.client_cert) != bool(self.client_key):
            raise GrpcTlsError("a client certificate needs its key, and a key its certificate: set both or "
                               "neither")
        for path in (self.root_cert, self.client_cert, self.client_key):
            if path:
                _read(path)

    def credentials(self) -> Any:
        """``grpc.ChannelCredentials`` of this setting (files read now: a rotated certificate is used by the
        next channel). Raises GrpcTlsError when a file became unreadable."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_cert),
            private_key=_read(self.client_key) if self.client_key else None,
            certificate_chain=_read(self.client_cert) if self.client_cert else None)

    def channel_args(self) -> list[tuple[str, str]]:
        """Channel options TLS adds (the target name override, when set)."""
        return [("grpc.ssl_target_name_override", self.target_name)] if self.target_name else []


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise GrpcTlsError(f"{path}: cannot read it: {exc.strerror or exc}") from None

