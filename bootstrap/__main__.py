"""``python -m bootstrap --host 127.0.0.1 --port 8998``: run the rendezvous service as its own process."""

from __future__ import annotations

import argparse
import logging

from bootstrap.registry import RegistryConfig
from bootstrap.server import ServerConfig, run_forever


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """The one place the CLI becomes a config."""
    parser = argparse.ArgumentParser(prog="python -m bootstrap",
                                     description="PD bootstrap rendezvous service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8998)
    parser.add_argument("--registration-ttl-s", type=float, default=10.0,
                        help="drop an instance that has not heartbeated for this long")
    parser.add_argument("--room-ttl-s", type=float, default=600.0)
    parser.add_argument("--ignore-sigint", action="store_true",
                        help="stop on SIGTERM only (scripts/serve.sh: outlive a Ctrl-C until the models stopped)")
    args = parser.parse_args(argv)
    return ServerConfig(host=args.host, port=args.port,
                        registry=RegistryConfig(registration_ttl_s=args.registration_ttl_s,
                                                room_ttl_s=args.room_ttl_s),
                        ignore_sigint=args.ignore_sigint)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_forever(parse_config(argv))


if __name__ == "__main__":
    main()
