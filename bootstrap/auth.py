"""Fleet secret authentication: the signed HTTP calls of the fleet (membership registry, rendezvous), the
signed child streams (``serving.child.codec``), the signed member records (``bootstrap.membership.member``)
and the key that unlocks tritonserver's admin APIs (``admin_key``).

Every request between fleet processes carries ``X-PD-Fleet-Auth: v2 t=<unix s>,n=<nonce hex>,s=<hmac hex>``,
where ``s`` is HMAC-SHA256 under the fleet secret of::

    v2 \\n METHOD \\n authority \\n path?query \\n t \\n nonce \\n sha256(body) hex

``authority`` is the target the caller meant: over HTTP the ``host:port`` it dialed (the ``Host`` header,
which ``HmacAuth`` sets to exactly what it signs, as RFC 9421's ``@authority`` and AWS SigV4's ``host`` do),
checked by the server against its own names (``Authorities``); on a child stream the target instance's id. So
a captured signature is good for one method, one path, one body, one server, 30 s, once: another body, path or
server fails the MAC, a second use within the window fails the replay guard (``ReplayGuard``), a later one the
clock.

Why HMAC with one shared secret, not TLS client certificates: the threat is a host that reaches a port (the
multi-host commands bind ``0.0.0.0``) and registers as a decode instance, posts destinations, aborts rooms or
sends child requests. A MAC gives integrity and origin (only holders of the secret sign) with one file to
distribute, no certificate authority and no expiry to manage. Confidentiality is TLS's, optional beside it
(docs/security.md). Signatures are compared with ``hmac.compare_digest`` (constant time). Everything in a
header is bounded and parsed strictly before any arithmetic, so a hostile header is a 401, never an exception.

``load_fleet_secret`` is the only reader of ``PD_FLEET_SECRET`` / ``PD_FLEET_SECRET_FILE``. One host with
every server on loopback needs no secret (``check_bind`` allows it); any other bind address requires one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import requests
from aiohttp import web
from aiohttp.typedefs import Middleware

from bootstrap.errors import BootstrapError

AUTH_HEADER = "X-PD-Fleet-Auth"
SCHEME = "v2"
SECRET_ENV = "PD_FLEET_SECRET"
SECRET_FILE_ENV = "PD_FLEET_SECRET_FILE"
DEFAULT_MAX_SKEW_S = 30.0
EXEMPT_ROUTES = frozenset({("GET", "/health")})   # liveness probes carry no secret
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthError(BootstrapError):
    """A message failed authentication, or the fleet secret is misconfigured; ``str()`` says which."""


def load_fleet_secret(environ: Mapping[str, str]) -> bytes | None:
    """The fleet secret: ``PD_FLEET_SECRET`` (the text) or ``PD_FLEET_SECRET_FILE`` (a file holding it,
    surrounding whitespace stripped) of ``environ`` (the process's environment, passed by its config layer or
    command line); None when neither is set (loopback-only fleets).

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


#: One signature header: scheme, a unix-seconds timestamp of at most 12 digits, a 16-64 hex-digit nonce and
#: the 64 hex digits of the HMAC; anything else is malformed (and refused before any arithmetic on ``t``).
_HEADER_RE = re.compile(r"v2 t=(?P<t>[0-9]{1,12}),n=(?P<n>[0-9a-f]{16,64}),s=(?P<s>[0-9a-f]{64})")
_MAX_HEADER_CHARS = 256


def _mac(secret: bytes, method: str, authority: str, path_qs: str, body: bytes, t: int, nonce: str) -> str:
    message = "\n".join([SCHEME, method.upper(), authority.lower(), path_qs, str(t), nonce,
                         hashlib.sha256(body).hexdigest()])
    return hmac.new(secret, message.encode("utf-8"), hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, authority: str, path_qs: str, body: bytes, now_s: float) -> str:
    """The ``X-PD-Fleet-Auth`` value for one request.

    Args:
        secret: the fleet secret.
        method: the HTTP method (any case), or the child stream's ``"POST"``.
        authority: the target: ``host:port`` as dialed over HTTP (``Authorities.normalize`` form: lower case,
            the port always written), or the target instance's id on a child stream.
        path_qs: the path with its query string exactly as sent (percent-encoding included).
        body: the bytes sent (b"" for none), or a digest of them (``signing.inputs_digest``).
        now_s: unix seconds.
    """
    t, nonce = int(now_s), secrets.token_hex(12)
    return f"{SCHEME} t={t},n={nonce},s={_mac(secret, method, authority, path_qs, body, t, nonce)}"


def _parse(header: str) -> tuple[int, str, str]:
    """(t, nonce, signature) of a header value; raises ``AuthError`` on any other shape."""
    if len(header) > _MAX_HEADER_CHARS:
        raise AuthError(f"malformed {AUTH_HEADER} header (longer than {_MAX_HEADER_CHARS} characters)")
    match = _HEADER_RE.fullmatch(header.strip())
    if match is None:
        scheme = header.strip().partition(" ")[0]
        if scheme != SCHEME:
            raise AuthError(f"unsupported {AUTH_HEADER} scheme {scheme[:16]!r}: this fleet speaks {SCHEME}")
        raise AuthError(
            f"malformed {AUTH_HEADER} header (want '{SCHEME} t=<unix s>,n=<hex nonce>,s=<hex mac>')")
    return int(match["t"]), match["n"], match["s"]


def verify(secret: bytes, method: str, authority: str, path_qs: str, body: bytes, header: str | None,
           now_s: float, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Checks one request's ``X-PD-Fleet-Auth`` value against ``secret`` (arguments as ``sign``'s); returns
    None when it is valid. Replays within the window are the caller's to refuse (``ReplayGuard``).

    Raises ``AuthError`` naming the reason: header missing or malformed, timestamp outside ``max_skew_s`` of
    ``now_s`` (unix seconds), or a signature that does not match method, authority, path with query and body.
    """
    if not header:
        raise AuthError(f"missing {AUTH_HEADER} header: this fleet requires the fleet secret ({SECRET_ENV})")
    t, nonce, signature = _parse(header)
    if abs(now_s - t) > max_skew_s:
        raise AuthError(f"timestamp outside the {max_skew_s:g} s window (sent {t}, now {int(now_s)}): "
                        "check the clocks, or a replayed request")
    if not hmac.compare_digest(signature, _mac(secret, method, authority, path_qs, body, t, nonce)):
        raise AuthError("bad signature: wrong fleet secret, another target, or the request was altered")


class ReplayGuard:
    """The (timestamp, nonce) pairs accepted while ``verify`` would still accept their timestamp; a pair seen
    twice is a replay. One per receiving server (a worker's two paths share one). Thread-safe; O(1) amortized
    per request; memory: the request rate times the window (~100 bytes a pair)."""

    def __init__(self, window_s: float = DEFAULT_MAX_SKEW_S) -> None:
        self._window_s = window_s
        self._seen: set[tuple[int, str]] = set()
        self._order: deque[tuple[float, tuple[int, str]]] = deque()   # (forget after, pair), arrival order
        self._lock = threading.Lock()

    def admit(self, header: str, now_s: float) -> None:
        """Records the header's (t, nonce); raises ``AuthError`` when it was already admitted (or is
        malformed). Call after ``verify`` accepted the header."""
        t, nonce, _ = _parse(header)
        with self._lock:
            while self._order and self._order[0][0] < now_s:
                self._seen.discard(self._order.popleft()[1])
            if (t, nonce) in self._seen:
                raise AuthError("replayed request (this signature was already used)")
            self._seen.add((t, nonce))
            self._order.append((t + self._window_s + 1.0, (t, nonce)))


_ReplayGuard = ReplayGuard   # the name used before it was public


class Authorities:
    """The ``host:port`` names a server answers to, for the signed authority of its requests.

    A signed authority is ours when its port is the port the connection arrived on and its host is the local
    address the connection arrived on, or one of ``names`` (the bind and advertised hosts given to the
    server), ``localhost``, or this machine's host name (``socket.gethostname``/``getfqdn``). The same
    signature sent to another server (another port, another address) names an authority that server does not
    have."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        own = {"localhost", socket.gethostname(), socket.getfqdn(), *names}
        self._names = frozenset(self.host_of(n) for n in own if n and n not in ("0.0.0.0", "::", "[::]"))

    @staticmethod
    def host_of(name: str) -> str:
        """``name`` lower-cased without IPv6 brackets (``[::1]`` → ``::1``)."""
        return name.strip().lower().strip("[]")

    @staticmethod
    def normalize(authority: str, default_port: int = 80) -> tuple[str, int]:
        """(host, port) of ``host``, ``host:port`` or ``[v6]:port``; the port defaults to ``default_port``.
        Raises ``AuthError`` on a port that is not a number in 0-65535 or an empty host."""
        authority = authority.strip().lower()
        if authority.startswith("["):
            host, _, rest = authority[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif authority.count(":") == 1:
            host, _, port_text = authority.partition(":")
        else:
            host, port_text = authority, ""
        if not host or (
                port_text and not (port_text.isdigit() and len(port_text) <= 5 and int(port_text) < 65536)):
            raise AuthError(f"malformed authority {authority[:64]!r}")
        return host, int(port_text) if port_text else default_port

    @staticmethod
    def canonical(authority: str, default_port: int = 80) -> str:
        """``host:port`` (``[v6]:port``), lower case, the port always written: what ``sign`` binds."""
        host, port = Authorities.normalize(authority, default_port)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def check(self, authority: str, local_host: str, local_port: int) -> str:
        """The canonical form of ``authority`` when it names this server as reached at ``local_host``:
        ``local_port`` (the connection's socket name); raises ``AuthError`` otherwise."""
        host, port = self.normalize(authority)
        if port != local_port or (host != self.host_of(local_host) and host not in self._names):
            raise AuthError(
                f"signed for another server ({authority[:64]!r}), not this one (port {local_port})")
        return self.canonical(authority)


def auth_middleware(secret: bytes | None, names: Iterable[str] = (), max_skew_s: float = DEFAULT_MAX_SKEW_S,
                    clock: Callable[[], float] | None = None) -> Middleware:
    """An aiohttp middleware: with no secret it passes every request through; with one, every route but
    ``GET /health`` must carry a valid ``X-PD-Fleet-Auth`` (see ``verify``) for this server (its ``Host``
    header one of ``Authorities(names)``, on the port the connection came in on) and a fresh nonce, otherwise
    the answer is HTTP 401 with the JSON body ``{"error": reason}``. ``clock`` (unix seconds) defaults to
    ``time.time``. Runs on the application's event loop; reads the body once (handlers can read it again)."""
    now = clock or time.time
    guard = ReplayGuard(max_skew_s)
    authorities = Authorities(names)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if secret is None or (request.method, request.path) in EXEMPT_ROUTES:
            return await handler(request)
        header = request.headers.get(AUTH_HEADER)
        try:
            local = request.transport.get_extra_info("sockname") if request.transport else None
            if not local:
                raise AuthError("the connection's local address is unknown")
            authority = authorities.check(request.headers.get("Host", ""), str(local[0]), int(local[1]))
            verify(secret, request.method, authority, request.raw_path, await request.read(), header, now(),
                   max_skew_s)
            guard.admit(header or "", now())
        except AuthError as exc:
            return web.json_response({"error": str(exc)}, status=401)
        return await handler(request)

    return middleware


class HmacAuth(requests.auth.AuthBase):
    """Signs every outgoing ``requests`` call with the fleet secret (``session.auth = HmacAuth(secret)`` or
    ``requests.get(url, auth=HmacAuth(secret))``): the URL's ``host:port`` (sent as the ``Host`` header,
    exactly as signed), path with query and body bytes as sent. Stateless."""

    def __init__(self, secret: bytes, clock: Callable[[], float] | None = None) -> None:
        self._secret = secret
        self._now = clock or time.time

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        if not isinstance(body, bytes):
            raise AuthError("HmacAuth signs bytes or str bodies only, not streamed ones")
        url = urlsplit(r.url or "")
        authority = Authorities.canonical(url.netloc.rpartition("@")[2], 443 if url.scheme == "https" else 80)
        r.headers["Host"] = authority
        r.headers[AUTH_HEADER] = sign(self._secret, r.method or "GET", authority, r.path_url, body,
                                      self._now())
        return r


def record_mac(secret: bytes, kind: str, payload: bytes) -> str:
    """HMAC-SHA256 (hex) under the fleet secret of a stored record (no time, no nonce: a record lives as long
    as its store keeps it): ``kind`` separates the domains (``"member"``), ``payload`` is the record's
    canonical bytes. Used where a store others may write holds what fleet processes read (etcd, the
    registry)."""
    return hmac.new(secret, b"pd-record\n" + kind.encode() + b"\n" + payload, hashlib.sha256).hexdigest()


def check_record_mac(secret: bytes, kind: str, payload: bytes, mac: object) -> None:
    """Raises ``AuthError`` unless ``mac`` is ``record_mac(secret, kind, payload)`` (constant-time
    compare)."""
    if not isinstance(mac, str) or len(mac) != 64:
        raise AuthError(f"unsigned {kind} record (no fleet signature)")
    if not hmac.compare_digest(mac, record_mac(secret, kind, payload)):
        raise AuthError(f"bad {kind} record signature: wrong fleet secret, or the record was altered")


#: The header that unlocks tritonserver's restricted APIs on a fleet server (``--http-restricted-api``,
#: ``--grpc-restricted-protocol``; lower case: gRPC metadata keys must be).
ADMIN_HEADER = "pd-admin-key"


def admin_key(secret: bytes) -> str:
    """The value of ``ADMIN_HEADER`` for a fleet whose secret is ``secret``: 64 hex digits derived from it
    (HMAC-SHA256 of a fixed label), so that tritonserver's command line, which any local user may read in
    ``/proc``, never holds the secret itself."""
    return hmac.new(secret, b"pd-triton-admin-key-v1", hashlib.sha256).hexdigest()


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


def main(argv: list[str] | None = None) -> int:
    """``python -m bootstrap.auth admin-key``: prints ``admin_key`` of the fleet secret in the environment
    (for ``curl -H "pd-admin-key: ..."`` and tritonserver's restricted-API flags). Exit 2 without a secret."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args != ["admin-key"]:
        print("usage: python -m bootstrap.auth admin-key", file=sys.stderr)
        return 2
    try:
        secret = load_fleet_secret(os.environ)
    except AuthError as exc:
        print(f"bootstrap.auth: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"bootstrap.auth: no fleet secret: set {SECRET_ENV} or {SECRET_FILE_ENV}", file=sys.stderr)
        return 2
    print(admin_key(secret))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
