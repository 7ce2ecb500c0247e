"""Interim fleet-secret hooks (replaced by the HMAC implementation of the auth-etcd branch)."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from bootstrap.errors import BootstrapError


class AuthError(BootstrapError):
    pass


def check_bind(host: str, secret: bytes | None, what: str) -> None:
    if secret is not None:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise AuthError(f"{what} binds {host}, which other hosts reach: set PD_FLEET_SECRET or PD_FLEET_SECRET_FILE")


def auth_middleware(secret: bytes | None) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def passthrough(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        return await handler(request)
    return passthrough


def load_fleet_secret(environ: Mapping[str, str]) -> bytes | None:
    value, path = environ.get("PD_FLEET_SECRET", ""), environ.get("PD_FLEET_SECRET_FILE", "")
    if value and path:
        raise AuthError("set PD_FLEET_SECRET or PD_FLEET_SECRET_FILE, not both")
    if path:
        try:
            text = open(path, encoding="utf-8").read().strip()
        except OSError as e:
            raise AuthError(f"cannot read PD_FLEET_SECRET_FILE {path}: {e}") from None
        if not text:
            raise AuthError(f"PD_FLEET_SECRET_FILE {path} is empty")
        return text.encode()
    return value.encode() if value else None
