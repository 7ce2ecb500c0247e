"""Fleet secret authentication: HMAC round trip and its refusals, the aiohttp middleware on a real app on
port 0, ``HmacAuth`` with real ``requests`` calls, the secret's loading and ``check_bind``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from aiohttp import web

from bootstrap.auth import (
    AUTH_HEADER,
    AuthError,
    Authorities,
    HmacAuth,
    ReplayGuard,
    admin_key,
    auth_middleware,
    check_bind,
    check_record_mac,
    load_fleet_secret,
    record_mac,
    sign,
    verify,
)

SECRET = b"fleet-secret-for-tests"
NOW = 1_800_000_000.0


AUTHORITY = "10.0.0.2:8998"


def test_a_signed_request_verifies() -> None:
    header = sign(SECRET, "POST", AUTHORITY, "/v1/rooms?x=1", b'{"room": 7}', NOW)
    assert header.startswith("v2 t=1800000000,n=")
    verify(SECRET, "POST", AUTHORITY, "/v1/rooms?x=1", b'{"room": 7}', header, NOW + 29.0)


@pytest.mark.parametrize("method, authority, path_qs, body, secret", [
    ("POST", AUTHORITY, "/v1/rooms?x=1", b'{"room": 8}', SECRET),        # body altered
    ("POST", AUTHORITY, "/v1/rooms?x=2", b'{"room": 7}', SECRET),        # query altered
    ("POST", AUTHORITY, "/v1/rooms/abort?x=1", b'{"room": 7}', SECRET),  # path altered
    ("DELETE", AUTHORITY, "/v1/rooms?x=1", b'{"room": 7}', SECRET),      # method altered
    ("POST", "10.0.0.3:8998", "/v1/rooms?x=1", b'{"room": 7}', SECRET),   # another server
    ("POST", "10.0.0.2:8999", "/v1/rooms?x=1", b'{"room": 7}', SECRET),   # another port of the same host
    ("POST", "decode@10.0.0.2:8001", "/v1/rooms?x=1", b'{"room": 7}', SECRET),   # another target instance
    ("POST", AUTHORITY, "/v1/rooms?x=1", b'{"room": 7}', b"another fleet"),
])
def test_any_change_breaks_the_signature(method: str, authority: str, path_qs: str, body: bytes,
                                         secret: bytes) -> None:
    header = sign(SECRET, "POST", AUTHORITY, "/v1/rooms?x=1", b'{"room": 7}', NOW)
    with pytest.raises(AuthError, match="bad signature"):
        verify(secret, method, authority, path_qs, body, header, NOW)


@pytest.mark.parametrize("skew_s", [-31.0, 31.0, -1e9])
def test_a_timestamp_outside_the_window_is_refused(skew_s: float) -> None:
    header = sign(SECRET, "GET", AUTHORITY, "/v1/members", b"", NOW)
    with pytest.raises(AuthError, match="timestamp outside the 30 s window"):
        verify(SECRET, "GET", AUTHORITY, "/v1/members", b"", header, NOW + skew_s)


@pytest.mark.parametrize("header, reason", [
    (None, "missing X-PD-Fleet-Auth header: this fleet requires the fleet secret .PD_FLEET_SECRET."),
    ("", "missing X-PD-Fleet-Auth header"),
    ("v1 t=1,n=2,s=3", "unsupported X-PD-Fleet-Auth scheme 'v1'"),
    ("v2 t=soon,n=00000000000000000,s=" + "0" * 64, "malformed X-PD-Fleet-Auth header"),
    ("v2 n=0000000000000000,s=" + "0" * 64, "malformed X-PD-Fleet-Auth header"),
    ("v2 t=1" + "0" * 400 + ",n=0000000000000000,s=" + "0" * 64, "malformed X-PD-Fleet-Auth header"),
    ("v2 t=1" + "0" * 40 + ",n=0000000000000000,s=" + "0" * 64, "malformed X-PD-Fleet-Auth header"),
    ("v2 t=1,n=0000000000000000,s=" + "0" * 63, "malformed X-PD-Fleet-Auth header"),
    ("v2 t=1,n=zz00000000000000,s=" + "0" * 64, "malformed X-PD-Fleet-Auth header"),
])
def test_a_missing_or_malformed_header_says_so(header: str | None, reason: str) -> None:
    with pytest.raises(AuthError, match=reason):
        verify(SECRET, "GET", AUTHORITY, "/v1/members", b"", header, NOW)


@pytest.mark.parametrize("authority, canonical", [
    ("10.0.0.2:8998", "10.0.0.2:8998"), ("Registry.Example:80", "registry.example:80"),
    ("registry.example", "registry.example:80"), ("[::1]:9000", "[::1]:9000"), ("[::1]", "[::1]:80"),
])
def test_authorities_are_compared_in_one_canonical_form(authority: str, canonical: str) -> None:
    assert Authorities.canonical(authority) == canonical


def test_an_authority_is_ours_only_on_our_port_and_under_our_names() -> None:
    ours = Authorities(["registry.example", "0.0.0.0"])
    assert ours.check("10.0.0.2:8998", "10.0.0.2", 8998) == "10.0.0.2:8998"      # the address dialed
    assert ours.check("Registry.Example:8998", "10.0.0.2", 8998) == "registry.example:8998"   # a given name
    assert ours.check("localhost:8998", "127.0.0.1", 8998) == "localhost:8998"
    for authority in ("10.0.0.2:8999", "10.0.0.3:8998", "other.example:8998", "0.0.0.0:8998"):
        with pytest.raises(AuthError, match="signed for another server"):
            ours.check(authority, "10.0.0.2", 8998)
    for authority in ("10.0.0.2:99999", "10.0.0.2:x", ":8998", "a:b:c"):
        with pytest.raises(AuthError, match="malformed authority|signed for another server"):
            ours.check(authority, "10.0.0.2", 8998)


def test_a_record_mac_binds_kind_and_payload() -> None:
    mac = record_mac(SECRET, "member", b'{"instance_id": "decode@h:1"}')
    check_record_mac(SECRET, "member", b'{"instance_id": "decode@h:1"}', mac)
    for secret, kind, payload in [(b"other", "member", b'{"instance_id": "decode@h:1"}'),
                                  (SECRET, "other", b'{"instance_id": "decode@h:1"}'),
                                  (SECRET, "member", b'{"instance_id": "decode@h:2"}')]:
        with pytest.raises(AuthError, match="bad member record signature|bad other record signature"):
            check_record_mac(secret, kind, payload, mac)
    for missing in (None, "", 7, "ab"):
        with pytest.raises(AuthError, match="unsigned member record"):
            check_record_mac(SECRET, "member", b"{}", missing)


def test_the_admin_key_is_derived_from_the_secret_and_is_not_it() -> None:
    key = admin_key(SECRET)
    assert len(key) == 64 and key == admin_key(SECRET) != admin_key(b"another fleet")
    assert SECRET.decode() not in key


class _App:
    """A real aiohttp app on 127.0.0.1, port 0, on its own thread: ``GET /health``, ``POST /echo``."""

    def __init__(self, secret: bytes | None) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(secret, ready), name="test-auth-app",
                                        daemon=True)
        self._thread.start()
        assert ready.wait(10.0) and self.port

    def _serve(self, secret: bytes | None, ready: threading.Event) -> None:
        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def start() -> None:
            app = web.Application(middlewares=[auth_middleware(secret)])
            app.add_routes([web.get("/health", health), web.post("/echo", echo), web.get("/echo", echo)])
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = self._runner.addresses[0][1]

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)


@pytest.fixture
def secured() -> Iterator[_App]:
    app = _App(SECRET)
    yield app
    app.stop()


def test_middleware_without_a_secret_passes_everything_through() -> None:
    app = _App(None)
    try:
        assert requests.post(app.url("/echo"), data=b"hello", timeout=5).content == b"hello"
    finally:
        app.stop()


def test_middleware_refuses_an_unsigned_request_with_the_reason(secured: _App) -> None:
    response = requests.post(secured.url("/echo"), data=b"hello", timeout=5)
    assert response.status_code == 401
    assert response.json() == {"error": "missing X-PD-Fleet-Auth header: this fleet requires the fleet "
                                        "secret (PD_FLEET_SECRET)"}


def test_middleware_exempts_only_get_health(secured: _App) -> None:
    assert requests.get(secured.url("/health"), timeout=5).text == "ok"
    assert requests.get(secured.url("/echo"), timeout=5).status_code == 401


def test_hmac_auth_signs_real_requests_that_the_middleware_accepts(secured: _App) -> None:
    with requests.Session() as session:
        session.auth = HmacAuth(SECRET)
        assert session.post(secured.url("/echo?a=1&b=%2F"), data=b"payload", timeout=5).content == b"payload"
        assert session.post(secured.url("/echo"), json={"k": "v"}, timeout=5).json() == {"k": "v"}
        assert session.get(secured.url("/echo?x=y"), timeout=5).status_code == 200


def test_middleware_refuses_a_wrong_secret_and_a_replay(secured: _App) -> None:
    wrong = requests.post(secured.url("/echo"), data=b"x", auth=HmacAuth(b"not the fleet's"), timeout=5)
    assert wrong.status_code == 401 and wrong.json()["error"].startswith("bad signature")
    first = requests.post(secured.url("/echo"), data=b"x", auth=HmacAuth(SECRET), timeout=5)
    assert first.status_code == 200
    header = first.request.headers[AUTH_HEADER]
    replay = requests.post(secured.url("/echo"), data=b"x", headers={AUTH_HEADER: header}, timeout=5)
    assert replay.status_code == 401 and "replayed" in replay.json()["error"]


def test_the_replay_guard_forgets_a_signature_once_verify_would_refuse_its_timestamp() -> None:
    guard = ReplayGuard(30.0)
    header = sign(SECRET, "GET", AUTHORITY, "/v1/members", b"", NOW)
    guard.admit(header, NOW)
    with pytest.raises(AuthError, match="replayed request"):
        guard.admit(header, NOW + 30.0)
    guard.admit(header, NOW + 31.5)   # forgotten (bounded memory): verify refuses this timestamp by now


def test_middleware_refuses_a_signature_for_another_body(secured: _App) -> None:
    header = sign(SECRET, "POST", f"127.0.0.1:{secured.port}", "/echo", b"what was signed", time.time())
    response = requests.post(secured.url("/echo"), data=b"what was sent",
                             headers={AUTH_HEADER: header}, timeout=5)
    assert response.status_code == 401 and response.json()["error"].startswith("bad signature")


def test_middleware_refuses_a_signature_made_for_another_server(secured: _App) -> None:
    """A call signed for (and sent to) another server on this host, replayed here: refused, though its
    method, path, body and time are all valid."""
    other = _App(SECRET)
    try:
        sent = requests.post(other.url("/echo"), data=b"x", auth=HmacAuth(SECRET), timeout=5)
        assert sent.status_code == 200
        replay = requests.post(secured.url("/echo"), data=b"x", timeout=5,
                               headers={AUTH_HEADER: sent.request.headers[AUTH_HEADER],
                                        "Host": sent.request.headers["Host"]})
        assert replay.status_code == 401 and "signed for another server" in replay.json()["error"]
        # the same signature with this server's Host header: the MAC names the other server
        replay = requests.post(secured.url("/echo"), data=b"x", timeout=5,
                               headers={AUTH_HEADER: sent.request.headers[AUTH_HEADER]})
        assert replay.status_code == 401 and replay.json()["error"].startswith("bad signature")
    finally:
        other.stop()


@pytest.mark.parametrize("header", [
    "v2 t=1" + "0" * 400 + ",n=0000000000000000,s=" + "0" * 64, "x" * 5_000, "x" * 10_000, "v2 t=,n=,s=",
    "\u00e9" * 20,
])
def test_middleware_answers_a_hostile_header_with_401_not_500(secured: _App, header: str) -> None:
    response = requests.post(secured.url("/echo"), data=b"x", headers={AUTH_HEADER: header.encode("utf-8")},
                             timeout=5)
    assert 400 <= response.status_code < 500, response.text   # 10 k: aiohttp's own limit answers 400 first


def test_load_fleet_secret_reads_the_variable_or_the_file(tmp_path: Path) -> None:
    assert load_fleet_secret({}) is None
    assert load_fleet_secret({"PD_FLEET_SECRET": " s3cret\n"}) == b"s3cret"
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    assert load_fleet_secret({"PD_FLEET_SECRET_FILE": str(path)}) == b"from-file"


def test_load_fleet_secret_refuses_bad_settings(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(AuthError, match="both PD_FLEET_SECRET and PD_FLEET_SECRET_FILE are set"):
        load_fleet_secret({"PD_FLEET_SECRET": "a", "PD_FLEET_SECRET_FILE": str(empty)})
    with pytest.raises(AuthError, match="the file is empty"):
        load_fleet_secret({"PD_FLEET_SECRET_FILE": str(empty)})
    with pytest.raises(AuthError, match="cannot read the fleet secret"):
        load_fleet_secret({"PD_FLEET_SECRET_FILE": str(tmp_path / "absent")})
    with pytest.raises(AuthError, match="PD_FLEET_SECRET is set but empty"):
        load_fleet_secret({"PD_FLEET_SECRET": " "})


def test_check_bind_allows_loopback_without_a_secret_and_nothing_else() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_bind(host, None, "the registry")
    for host in ("0.0.0.0", "10.0.0.2", "::", "myhost"):
        check_bind(host, SECRET, "the registry")
        with pytest.raises(AuthError, match=f"the registry binds {host}, which other hosts reach: set "
                                            "PD_FLEET_SECRET or PD_FLEET_SECRET_FILE"):
            check_bind(host, None, "the registry")
