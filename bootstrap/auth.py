"""Fleet secret authentication of the fleet's HTTP messages (membership registry, rendezvous).

Every request between fleet processes carries ``X-PD-Fleet-Auth: v1 t=<unix s>,n=<nonce hex>,s=<hmac hex>``,
where ``s`` is HMAC-SHA256 under the fleet secret of::

    v1 \\n METHOD \\n path?query \\n t \\n nonce \\n sha256(body) hex

Why HMAC with one shared secret, not TLS: the threat is a host that reaches a port (the README's multi-host
commands bind ``0.0.0.0``) and registers as a decode instance, posts destinations or aborts rooms. A MAC over
method, path with query and body gives integrity and origin (only holders of the secret sign) with one file to
distribute, no certificate authority, no expiry to manage, and no change to the plain-HTTP servers and clients.
What it does not give: confidentiality (the messages carry addresses and page ids, no prompts; KV moves over
NIXL/Mooncake, outside this). Freshness: the timestamp must lie within ``max_skew_s`` (30 s) of the receiver's
clock, and ``auth_middleware`` refuses a (timestamp, nonce) pair it has already accepted within that window, so
a captured request cannot be replayed. Signatures are compared with ``hmac.compare_digest`` (constant time).

``load_fleet_secret`` is the only reader of ``PD_FLEET_SECRET`` / ``PD_FLEET_SECRET_FILE``. One host with every
server on loopback needs no secret (``check_bind`` allows it); any other bind address requires one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import requests
from aiohttp import web
from aiohttp.typedefs import Middleware

from bootstrap.errors import BootstrapError

AUTH_HEADER = "X-PD-Fleet-Auth"
SCHEME = "v1"
SECRET_ENV = "PD_FLEET_SECRET"
SECRET_FILE_ENV = "PD_FLEET_SECRET_FILE"
DEFAULT_MAX_SKEW_S = 30.0
EXEMPT_ROUTES = frozenset({("GET", "/health")})   # liveness probes carry no secret
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthError(BootstrapError):
    """A message failed authentication, or the fleet secret is misconfigured; ``str()`` says which."""


def load_fleet_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The fleet secret: ``PD_FLEET_SECRET`` (the text) or ``PD_FLEET_SECRET_FILE`` (a file holding it,
    surrounding whitespace stripped); None when neither is set (loopback-only fleets).

    Raises ``AuthError`` when both are set, the file cannot be read, or the secret is empty.
    """
    text, path = environ.get(SECRET_ENV, ""), environ.get(SECRET_FILE_ENV, "")
    if text and path:
        raise AuthError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthError(f"{SECRET_FILE_ENV}={path}: cannot read the fleet secret: {exc}") from exc
        if not text.strip():
            raise AuthError(f"{SECRET_FILE_ENV}={path}: the file is empty")
    elif SECRET_ENV in environ and not text.strip():
        raise AuthError(f"{SECRET_ENV} is set but empty")
    secret = text.strip()
    return secret.encode("utf-8") if secret else None


def _mac(secret: bytes, method: str, path_qs: str, body: bytes, t: int, nonce: str) -> str:
    message = "\n".join([SCHEME, method.upper(), path_qs, str(t), nonce, hashlib.sha256(body).hexdigest()])
    return hmac.new(secret, message.encode("utf-8"), hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path_qs: str, body: bytes, now_s: float) -> str:
    """The ``X-PD-Fleet-Auth`` value for one request: ``path_qs`` is the path with its query string exactly
    as sent (percent-encoding included), ``body`` the bytes sent (b"" for none), ``now_s`` unix seconds."""
    t, nonce = int(now_s), secrets.token_hex(8)
    return f"{SCHEME} t={t},n={nonce},s={_mac(secret, method, path_qs, body, t, nonce)}"


def _parse(header: str) -> tuple[int, str, str]:
    """(t, nonce, signature) of a header value; raises ``AuthError`` on any other shape."""
    scheme, _, fields_text = header.strip().partition(" ")
    if scheme != SCHEME:
        raise AuthError(f"unsupported {AUTH_HEADER} scheme {scheme[:16]!r}: this fleet speaks {SCHEME}")
    fields = dict(part.partition("=")[::2] for part in fields_text.split(","))
    try:
        return int(fields["t"]), fields["n"], fields["s"]
    except (KeyError, ValueError) as exc:
        raise AuthError(f"malformed {AUTH_HEADER} header (want '{SCHEME} t=<unix s>,n=<nonce>,s=<hex>')") from exc


def verify(secret: bytes, method: str, path_qs: str, body: bytes, header: str | None, now_s: float,
           max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Checks one request's ``X-PD-Fleet-Auth`` value against ``secret``; returns None when it is valid.

    Raises ``AuthError`` naming the reason: header missing or malformed, timestamp outside ``max_skew_s`` of
    ``now_s`` (unix seconds), or a signature that does not match method, path with query and body.
    """
    if not header:
        raise AuthError(f"missing {AUTH_HEADER} header: this fleet requires the fleet secret ({SECRET_ENV})")
    t, nonce, signature = _parse(header)
    if abs(now_s - t) > max_skew_s:
        raise AuthError(f"timestamp outside the {max_skew_s:g} s window (sent {t}, now {int(now_s)}): "
                        "check the clocks, or a replayed request")
    if not hmac.compare_digest(signature, _mac(secret, method, path_qs, body, t, nonce)):
        raise AuthError("bad signature: wrong fleet secret, or the request was altered")


class _ReplayGuard:
    """The (timestamp, nonce) pairs accepted while ``verify`` would still accept their timestamp; a pair seen
    twice is a replay. Thread-safe; O(1) amortized per request; memory: the request rate times the window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: set[tuple[int, str]] = set()
        self._order: deque[tuple[float, tuple[int, str]]] = deque()   # (forget after, pair), arrival order
        self._lock = threading.Lock()

    def admit(self, header: str, now_s: float) -> None:
        t, nonce, _ = _parse(header)
        with self._lock:
            while self._order and self._order[0][0] < now_s:
                self._seen.discard(self._order.popleft()[1])
            if (t, nonce) in self._seen:
                raise AuthError("replayed request (this signature was already used)")
            self._seen.add((t, nonce))
            self._order.append((t + self._window_s + 1.0, (t, nonce)))


def auth_middleware(secret: bytes | None, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                    clock: Callable[[], float] | None = None) -> Middleware:
    """An aiohttp middleware: with no secret it passes every request through; with one, every route but
    ``GET /health`` must carry a valid ``X-PD-Fleet-Auth`` (see ``verify``) and a fresh nonce, otherwise the
    answer is HTTP 401 with the JSON body ``{"error": reason}``. ``clock`` (unix seconds) defaults to
    ``time.time``. Runs on the application's event loop; reads the body once (handlers can read it again)."""
    now = clock or time.time
    guard = _ReplayGuard(max_skew_s)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if secret is None or (request.method, request.path) in EXEMPT_ROUTES:
            return await handler(request)
        header = request.headers.get(AUTH_HEADER)
        try:
            verify(secret, request.method, request.raw_path, await request.read(), header, now(), max_skew_s)
            guard.admit(header or "", now())
        except AuthError as exc:
            return web.json_response({"error": str(exc)}, status=401)
        return await handler(request)

    return middleware


class HmacAuth(requests.auth.AuthBase):
    """Signs every outgoing ``requests`` call with the fleet secret (``session.auth = HmacAuth(secret)`` or
    ``requests.get(url, auth=HmacAuth(secret))``): path with query and body bytes as sent. Stateless."""

    def __init__(self, secret: bytes, clock: Callable[[], float] | None = None) -> None:
        self._secret = secret
        self._now = clock or time.time

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        if not isinstance(body, bytes):
            raise AuthError("HmacAuth signs bytes or str bodies only, not streamed ones")
        r.headers[AUTH_HEADER] = sign(self._secret, r.method or "GET", r.path_url, body, self._now())
        return r


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ::1; hostnames other than ``localhost`` count
    as reachable from other hosts (they are not resolved)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: bytes | None, what: str) -> None:
    """Refuses to serve fleet messages on a non-loopback ``host`` without a fleet secret.

    ``what`` names the server in the message (e.g. ``"the membership registry"``). Raises ``AuthError``."""
    if secret is None and not is_loopback(host):
        raise AuthError(f"{what} binds {host or '0.0.0.0'}, which other hosts reach: set {SECRET_ENV} or "
                        f"{SECRET_FILE_ENV}")
