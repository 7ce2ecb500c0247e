"""Interim fleet-secret hooks (replaced by the HMAC implementation of the auth-etcd branch)."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

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
