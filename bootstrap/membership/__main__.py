"""``python -m bootstrap.membership --host 127.0.0.1 --port 8997``: the membership registry as its own process.

A bind address other hosts reach (not loopback) requires the fleet secret (``PD_FLEET_SECRET`` or
``PD_FLEET_SECRET_FILE``); the process exits with the reason otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from bootstrap.auth import AuthError, check_bind, load_fleet_secret
from bootstrap.membership.service import run_forever

DEFAULT_PORT = 8997


@dataclass(frozen=True)
class RegistryArgs:
    host: str
    port: int
    ttl_s: float
    ignore_sigint: bool
    advertise_host: str = ""


def parse_args(argv: list[str] | None = None) -> RegistryArgs:
    """The one place the CLI becomes a config."""
    parser = argparse.ArgumentParser(prog="python -m bootstrap.membership",
                                     description="PD fleet membership registry (embedded default backend)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--advertise-host", default="",
                        help="the host name or address members dial (PD_REGISTRY_URL's host), when not --host: "
                             "signed calls name the server they are for")
    parser.add_argument("--ttl-s", type=float, default=10.0,
                        help="TTL of a registration that does not name its own")
    parser.add_argument("--ignore-sigint", action="store_true",
                        help="stop on SIGTERM only (a launcher's Ctrl-C must not stop it before the members)")
    args = parser.parse_args(argv)
    return RegistryArgs(args.host, args.port, args.ttl_s, args.ignore_sigint, args.advertise_host)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        secret = load_fleet_secret()
        check_bind(args.host, secret, "the membership registry")
    except AuthError as exc:
        print(f"python -m bootstrap.membership: {exc}", file=sys.stderr)
        return 2
    run_forever(args.host, args.port, secret, args.ttl_s, args.ignore_sigint, args.advertise_host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
