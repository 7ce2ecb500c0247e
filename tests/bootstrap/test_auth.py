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
    HmacAuth,
    _ReplayGuard,
    auth_middleware,
    check_bind,
    load_fleet_secret,
    sign,
    verify,
)

SECRET = b"fleet-secret-for-tests"
NOW = 1_800_000_000.0


def test_a_signed_request_verifies() -> None:
    header = sign(SECRET, "POST", "/v1/rooms?x=1", b'{"room": 7}', NOW)
    assert header.startswith("v1 t=1800000000,n=")
    verify(SECRET, "POST", "/v1/rooms?x=1", b'{"room": 7}', header, NOW + 29.0)


@pytest.mark.parametrize("method, path_qs, body, secret", [
    ("POST", "/v1/rooms?x=1", b'{"room": 8}', SECRET),      # body altered
    ("POST", "/v1/rooms?x=2", b'{"room": 7}', SECRET),      # query altered
    ("POST", "/v1/rooms/abort?x=1", b'{"room": 7}', SECRET),  # path altered
    ("DELETE", "/v1/rooms?x=1", b'{"room": 7}', SECRET),    # method altered
    ("POST", "/v1/rooms?x=1", b'{"room": 7}', b"another fleet"),
])
def test_any_change_breaks_the_signature(method: str, path_qs: str, body: bytes, secret: bytes) -> None:
    header = sign(SECRET, "POST", "/v1/rooms?x=1", b'{"room": 7}', NOW)
    with pytest.raises(AuthError, match="bad signature"):
        verify(secret, method, path_qs, body, header, NOW)


@pytest.mark.parametrize("skew_s", [-31.0, 31.0])
def test_a_timestamp_outside_the_window_is_refused(skew_s: float) -> None:
    header = sign(SECRET, "GET", "/v1/members", b"", NOW)
    with pytest.raises(AuthError, match="timestamp outside the 30 s window"):
        verify(SECRET, "GET", "/v1/members", b"", header, NOW + skew_s)


@pytest.mark.parametrize("header, reason", [
    (None, "missing X-PD-Fleet-Auth header: this fleet requires the fleet secret .PD_FLEET_SECRET."),
    ("", "missing X-PD-Fleet-Auth header"),
    ("v2 t=1,n=2,s=3", "unsupported X-PD-Fleet-Auth scheme 'v2'"),
    ("v1 t=soon,n=2,s=3", "malformed X-PD-Fleet-Auth header"),
    ("v1 n=2,s=3", "malformed X-PD-Fleet-Auth header"),
])
def test_a_missing_or_malformed_header_says_so(header: str | None, reason: str) -> None:
    with pytest.raises(AuthError, match=reason):
        verify(SECRET, "GET", "/v1/members", b"", header, NOW)


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
    assert response.json() == {"error": "missing X-PD-Fleet-Auth header: this fleet requires the fleet secret "
                                        "(PD_FLEET_SECRET)"}


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
    guard = _ReplayGuard(30.0)
    header = sign(SECRET, "GET", "/v1/members", b"", NOW)
    guard.admit(header, NOW)
    with pytest.raises(AuthError, match="replayed request"):
        guard.admit(header, NOW + 30.0)
    guard.admit(header, NOW + 31.5)   # forgotten (bounded memory): verify refuses this timestamp by now


def test_middleware_refuses_a_signature_for_another_body(secured: _App) -> None:
    header = sign(SECRET, "POST", "/echo", b"what was signed", time.time())
    response = requests.post(secured.url("/echo"), data=b"what was sent", headers={AUTH_HEADER: header}, timeout=5)
    assert response.status_code == 401 and response.json()["error"].startswith("bad signature")


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
