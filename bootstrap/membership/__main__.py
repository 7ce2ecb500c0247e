"""``python -m bootstrap.membership --host 127.0.0.1 --port 8997``: the membership registry as its own
process.

A bind address other hosts reach (not loopback) requires the fleet secret (``PD_FLEET_SECRET`` or
``PD_FLEET_SECRET_FILE``); the process exits with the reason otherwise. ``--tls-cert/--tls-key/--tls-ca``
(or ``PD_TLS_CERT``/``PD_TLS_KEY``/``PD_TLS_CA``, all three or none) serve HTTPS (``bootstrap.tls``; the
certificate must name ``--advertise-host``, the host of the members' ``PD_REGISTRY_URL=https://...``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from bootstrap.auth import AuthError, check_bind, load_fleet_secret
from bootstrap.membership.service import run_forever
from bootstrap.tls import FleetTLS, TLSError, load_fleet_tls

DEFAULT_PORT = 8997


@dataclass(frozen=True)
class RegistryArgs:
    host: str
    port: int
    ttl_s: float
    ignore_sigint: bool
    advertise_host: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def fleet_tls(self) -> FleetTLS | None:
        """The TLS setting: the three ``--tls-*`` flags when given (all three), else ``PD_TLS_*`` from the
        environment; None: plaintext. Raises ``TLSError`` naming the flag, variable or file."""
        flags = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca}
        if not any(flags.values()):
            return load_fleet_tls(os.environ)
        missing = [flag for flag, value in flags.items() if not value]
        if missing:
            raise TLSError(f"{', '.join(missing)} missing: --tls-cert, --tls-key and --tls-ca go together")
        return FleetTLS(self.tls_cert, self.tls_key, self.tls_ca)


def parse_args(argv: list[str] | None = None) -> RegistryArgs:
    """The one place the CLI becomes a config."""
    parser = argparse.ArgumentParser(prog="python -m bootstrap.membership",
                                     description="PD fleet membership registry (embedded default backend)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--advertise-host", default="",
                        help="the host name or address members dial (PD_REGISTRY_URL's host), when not "
                             "--host: signed calls name the server they are for")
    parser.add_argument("--ttl-s", type=float, default=10.0,
                        help="TTL of a registration that does not name its own")
    parser.add_argument("--ignore-sigint", action="store_true",
                        help="stop on SIGTERM only (a launcher's Ctrl-C must not stop it before the members)")
    parser.add_argument("--tls-cert", default="", help="serve HTTPS with this PEM certificate chain (it must "
                        "name the advertised host; default: PD_TLS_CERT)")
    parser.add_argument("--tls-key", default="", help="its PEM private key (default: PD_TLS_KEY)")
    parser.add_argument("--tls-ca", default="", help="the fleet's CA, PEM (default: PD_TLS_CA)")
    args = parser.parse_args(argv)
    return RegistryArgs(args.host, args.port, args.ttl_s, args.ignore_sigint, args.advertise_host,
                        args.tls_cert, args.tls_key, args.tls_ca)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        secret = load_fleet_secret(os.environ)
        check_bind(args.host, secret, "the membership registry")
        tls = args.fleet_tls()
    except (AuthError, TLSError) as exc:
        print(f"python -m bootstrap.membership: {exc}", file=sys.stderr)
        return 2
    run_forever(args.host, args.port, secret, args.ttl_s, args.ignore_sigint, args.advertise_host, tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
