"""``python -m frontend``: the OpenAI-compatible front as its own process (uvicorn, one event loop).

    python -m frontend --host 127.0.0.1 --port 9000 --grpc-url 127.0.0.1:8001 --model pd_ensemble \
        --served-model-name smollm2

SIGINT/SIGTERM stop it: uvicorn stops accepting, lets open streams run for ``--graceful-shutdown-s``, then
cancels them (each cancel reaches the server as a cancelled request), then closes the gRPC channel.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from fastapi import FastAPI

from frontend.app import create_app
from frontend.backend import GrpcTlsFiles, TritonGrpcBackend
from frontend.chat import ChatRenderer
from frontend.config import FrontendConfig


def parse_config(argv: Sequence[str] | None = None) -> tuple[FrontendConfig, str]:
    """The front's config and uvicorn's log level from the command line (the one place it is built)."""
    d = FrontendConfig()
    p = argparse.ArgumentParser(prog="python -m frontend", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--grpc-url", default=d.grpc_url, help="tritonserver gRPC endpoint, host:port")
    p.add_argument("--model", default=d.model, help="Triton model to call (pd_ensemble, colocated)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="the model name clients use (default: --model)")
    p.add_argument("--tokenizer", default=d.tokenizer, help="whose chat template renders chat messages")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a chat request that sets none")
    p.add_argument("--graceful-shutdown-s", type=float, default=d.graceful_shutdown_s)
    p.add_argument("--grpc-keepalive-s", type=float, default=d.grpc_keepalive_s,
                   help="HTTP/2 keepalive pings to the server (0: none; the server must permit the interval)")
    p.add_argument("--grpc-ssl-root-cert", default=d.grpc_ssl_root_cert,
                   help="PEM CA of the server's certificate: TLS to a tritonserver with --grpc-use-ssl")
    p.add_argument("--grpc-ssl-client-cert", default=d.grpc_ssl_client_cert,
                   help="PEM certificate the front presents (a server with --grpc-use-ssl-mutual)")
    p.add_argument("--grpc-ssl-client-key", default=d.grpc_ssl_client_key, help="its PEM private key")
    p.add_argument("--grpc-ssl-target-name", default=d.grpc_ssl_target_name,
                   help="the name the server's certificate must hold (default: the host of --grpc-url)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = p.parse_args(argv)
    config = FrontendConfig(host=a.host, port=a.port, grpc_url=a.grpc_url, model=a.model,
                            served_model_name=a.served_model_name, tokenizer=a.tokenizer,
                            default_max_tokens=a.default_max_tokens,
                            graceful_shutdown_s=a.graceful_shutdown_s,
                            grpc_keepalive_s=a.grpc_keepalive_s, grpc_ssl_root_cert=a.grpc_ssl_root_cert,
                            grpc_ssl_client_cert=a.grpc_ssl_client_cert,
                            grpc_ssl_client_key=a.grpc_ssl_client_key,
                            grpc_ssl_target_name=a.grpc_ssl_target_name)
    return config, a.log_level


def build_app(config: FrontendConfig) -> FastAPI:
    """The app with its real collaborators (the gRPC backend, the model's chat template)."""
    tls = GrpcTlsFiles(config.grpc_ssl_root_cert, config.grpc_ssl_client_cert, config.grpc_ssl_client_key,
                       config.grpc_ssl_target_name) if config.grpc_ssl_root_cert else None
    backend = TritonGrpcBackend(config.grpc_url, config.model, keepalive_s=config.grpc_keepalive_s, tls=tls)
    return create_app(config, backend, ChatRenderer.load(config.tokenizer))


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    config, log_level = parse_config(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    logging.getLogger(__name__).info("OpenAI front on http://%s:%d -> %s at %s (served as %r)", config.host,
                                     config.port, config.model, config.grpc_url, config.public_name)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=int(config.graceful_shutdown_s) or None)


if __name__ == "__main__":
    main()
