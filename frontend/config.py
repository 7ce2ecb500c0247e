"""The front's configuration: one frozen dataclass, built once from the command line
(``frontend.__main__``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FrontendConfig:
    """
    Attributes:
        host, port: where the HTTP server listens.
        grpc_url: the tritonserver to send requests to (``host:port``).
        model: the Triton model requests go to (``pd_ensemble``, ``colocated``).
        served_model_name: the ``model`` name clients use and ``/v1/models`` lists (empty: ``model``).
        tokenizer: whose chat template renders chat messages (``smollm2``, a ``.gguf`` path or an HF folder).
        default_max_tokens: a chat request's ``max_tokens`` when it sets none (the server reserves KV pages
            for prompt + max_tokens up front, so "up to the context length" would cost a whole context per
            request).
        graceful_shutdown_s: how long open streams may run on at shutdown before they are cancelled.
        grpc_keepalive_s: HTTP/2 keepalive pings to the server, seconds; 0 = none (see ``TritonGrpcBackend``:
            tritonserver's defaults answer frequent pings with GOAWAY, which breaks every open stream).
        grpc_ssl_root_cert: PEM file of the CA that signed the server's certificate: the front speaks TLS to a
            tritonserver with ``--grpc-use-ssl``; empty: plaintext.
        grpc_ssl_client_cert, grpc_ssl_client_key: PEM certificate and key the front presents (a server with
            ``--grpc-use-ssl-mutual``); both or neither, and only with ``grpc_ssl_root_cert``.
        grpc_ssl_target_name: the name the server's certificate is checked against instead of the host of
            ``grpc_url``; empty: that host.
    """

    host: str = "127.0.0.1"
    port: int = 9000
    grpc_url: str = "127.0.0.1:8001"
    model: str = "pd_ensemble"
    served_model_name: str = ""
    tokenizer: str = "smollm2"
    default_max_tokens: int = 512
    graceful_shutdown_s: float = 5.0
    grpc_keepalive_s: float = 0.0
    grpc_ssl_root_cert: str = ""
    grpc_ssl_client_cert: str = ""
    grpc_ssl_client_key: str = ""
    grpc_ssl_target_name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        if ":" not in self.grpc_url:
            raise ValueError(f"grpc_url must be host:port, got {self.grpc_url!r}")
        if self.grpc_keepalive_s < 0:
            raise ValueError(f"grpc_keepalive_s must be >= 0, got {self.grpc_keepalive_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if bool(self.grpc_ssl_client_cert) != bool(self.grpc_ssl_client_key):
            raise ValueError("grpc_ssl_client_cert and grpc_ssl_client_key go together: set both or neither")
        if not self.grpc_ssl_root_cert and (self.grpc_ssl_client_cert or self.grpc_ssl_target_name):
            raise ValueError("the other grpc_ssl_* settings need grpc_ssl_root_cert")

    @property
    def public_name(self) -> str:
        return self.served_model_name or self.model
