"""Who may use a fleet tritonserver's admin APIs: the restriction every launcher of ours puts on them, and
the header our own callers send.

With explicit model control, ``POST /v2/repository/models/<m>/load`` can carry a whole python model in its
body: whoever reaches an unrestricted HTTP or gRPC port runs code in that server (and reads the fleet secret
from its environment). So whenever a fleet secret is set, every tritonserver we start answers the admin APIs
(``ADMIN_APIS``) only to requests carrying ``pd-admin-key: <admin_key(secret)>``
(``--http-restricted-api``, ``--grpc-restricted-protocol``), and keeps health, metadata and inference open:
clients and routers need those. The key is derived from the secret (``bootstrap.auth.admin_key``), so
tritonserver's command line, readable by any local user, never holds the secret itself. Our own callers of
those APIs (the router's read of its server's repository index) send ``admin_headers(secret)``; an operator
sends the header with the key printed by ``python -m bootstrap.auth admin-key`` (docs/security.md); over
gRPC its name carries tritonserver's prefix (``GRPC_HEADER_PREFIX``).

``python -m serving.triton.admin_access server-args --host HOST`` prints the tritonserver arguments, one a
line (none without a secret), for ``scripts/serve.sh``; it refuses (exit 2, the reason on stderr) a
non-loopback ``HOST`` without a fleet secret, and a misconfigured secret.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from bootstrap.auth import ADMIN_HEADER, AuthError, admin_key, check_bind, load_fleet_secret

#: tritonserver's admin APIs (its names, as ``--http-restricted-api`` takes them): loading code, reading
#: configurations and statistics, registering shared memory, tracing and logging settings. Left open: health,
#: metadata, inference.
ADMIN_APIS: tuple[str, ...] = ("model-repository", "model-config", "shared-memory", "statistics", "trace",
                               "logging")
#: tritonserver 2.51 checks a restricted gRPC protocol's header under this prefix (``pd-admin-key`` on HTTP is
#: ``triton-grpc-protocol-pd-admin-key`` in gRPC metadata; a call without it is refused with UNAVAILABLE)
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


def restricted_api_args(secret: bytes | None) -> list[str]:
    """The tritonserver arguments that restrict ``ADMIN_APIS`` on HTTP and gRPC to ``admin_headers(secret)``;
    [] without a secret (every server on loopback: nothing to restrict)."""
    if secret is None:
        return []
    rule = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={admin_key(secret)}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def admin_headers(secret: bytes | None, grpc: bool = False) -> dict[str, str]:
    """The header a call to an admin API of a fleet server carries (tritonclient's ``headers=``); {} without a
    secret. ``grpc``: the gRPC metadata key, which tritonserver expects with its ``GRPC_HEADER_PREFIX``."""
    if secret is None:
        return {}
    return {(GRPC_HEADER_PREFIX if grpc else "") + ADMIN_HEADER: admin_key(secret)}


def server_args(host: str, secret: bytes | None) -> list[str]:
    """``restricted_api_args(secret)`` for a tritonserver whose HTTP and gRPC bind ``host``.

    Raises:
        AuthError: ``host`` is reachable from other hosts (not loopback) and there is no secret.
    """
    check_bind(host, secret, "tritonserver")
    return restricted_api_args(secret)


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The CLI (module docstring). Reads the secret as the fleet's other command lines do
    (``bootstrap.auth.load_fleet_secret``, not ``serving.config``: no torch import in a launcher's path)."""
    parser = argparse.ArgumentParser(prog="python -m serving.triton.admin_access",
                                     description="tritonserver arguments restricting its admin APIs")
    parser.add_argument("command", choices=["server-args"])
    parser.add_argument("--host", required=True, help="the address tritonserver's HTTP and gRPC bind")
    args = parser.parse_args(argv)
    try:
        lines = server_args(args.host, load_fleet_secret(os.environ if environ is None else environ))
    except AuthError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
