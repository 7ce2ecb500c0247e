"""The embedded membership registry: an aiohttp service around ``MemberTable``, authenticated with
``bootstrap.auth.auth_middleware`` (every route but ``GET /health`` needs the fleet secret when one is set).

Routes (JSON bodies; ``{id}`` is the percent-encoded ``instance_id``, which may hold ``/``):
  PUT    /v1/members/{id}                  {"version": 2, "member": Member, "ttl_s": s}  -> 200 {"stored":
  true}
                                           (no ttl_s: the registry's default ``ttl_s``)
                                           409 {"error"}: the registry holds a newer epoch of that id
                                           403 {"error"}: with a fleet secret, a member not signed with it
  POST   /v1/members/{id}/keepalive?epoch=E                                            -> 200, 404: put again
  DELETE /v1/members/{id}?epoch=E                                                     -> 200, 404: not that
  epoch GET    /v1/members                       -> 200 {"version": 2, "members": [Member, ...]} (live ones,
  sorted) GET    /health                           -> "ok" (no secret needed)
With the fleet's TLS setting (``bootstrap.tls.FleetTLS``) it serves HTTPS only (``https://`` URLs).
Errors: 400 {"error"} for a body we cannot read, 401 {"error"} from the middleware. The member check on PUT
keeps unsigned records out of the table; the check that counts is the readers' own (``MemberCheck``), which
holds even when the registry is open or not this one. Expiry runs on every request and on a timer
(``ttl_s / 10``-ish, at most 0.5 s), so a silent member drops out within its TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from bootstrap.auth import auth_middleware
from bootstrap.errors import BootstrapError
from bootstrap.membership.member import MEMBER_VERSION, Member, MembershipError, MemberSignatureError
from bootstrap.membership.table import MemberTable, PutResult

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

logger = logging.getLogger(__name__)
EXPIRE_INTERVAL_S = 0.1
#: The longest registration a PUT may ask for (s): a member that stops renewing leaves within this, always.
MAX_TTL_S = 3600.0


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


def _epoch(request: web.Request) -> int:
    try:
        return int(request.query["epoch"])
    except (KeyError, ValueError) as exc:
        raise MembershipError("query parameter epoch=<int> is required") from exc


class _Handlers:
    def __init__(self, table: MemberTable, default_ttl_s: float, secret: bytes | None) -> None:
        self._table = table
        self._default_ttl_s = default_ttl_s
        self._secret = secret

    def expire(self) -> None:
        for member in self._table.expire(time.monotonic()):
            logger.warning("member %s (epoch %d) expired: no keepalive within its TTL", member.instance_id,
                           member.epoch)

    async def put(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict) or body.get("version") != MEMBER_VERSION:
                raise MembershipError(f"PUT body must be {{'version': {MEMBER_VERSION}, 'member', 'ttl_s'}}")
            member, ttl_s = Member.from_dict(body.get("member")), float(
                body.get("ttl_s", self._default_ttl_s))
            if member.instance_id != request.match_info["instance_id"] or not 0 < ttl_s <= MAX_TTL_S:
                raise MembershipError(f"the path's id must be the member's instance_id, and 0 < ttl_s <= "
                                      f"{MAX_TTL_S:g}")
        except (ValueError, TypeError, MembershipError) as exc:
            return _error(400, f"bad member registration: {exc}")
        try:
            if self._secret is not None:
                member.check(self._secret)
        except MemberSignatureError as exc:
            return _error(403, f"member {member.instance_id}: {exc}")
        if self._table.put(member, ttl_s, time.monotonic()) is PutResult.STALE_EPOCH:
            return _error(409, f"{member.instance_id}: the registry holds a newer epoch than {member.epoch}")
        logger.info("member %s %s epoch %d (ttl %.1f s)", member.role, member.instance_id,
                    member.epoch, ttl_s)
        return web.json_response({"stored": True})

    async def keepalive(self, request: web.Request) -> web.Response:
        try:
            epoch = _epoch(request)
        except MembershipError as exc:
            return _error(400, str(exc))
        known = self._table.keepalive(request.match_info["instance_id"], epoch, time.monotonic())
        return web.json_response({"renewed": known}, status=200 if known else 404)

    async def delete(self, request: web.Request) -> web.Response:
        try:
            epoch = _epoch(request)
        except MembershipError as exc:
            return _error(400, str(exc))
        deleted = self._table.delete(request.match_info["instance_id"], epoch)
        if deleted:
            logger.info("member %s withdrawn", request.match_info["instance_id"])
        return web.json_response({"deleted": deleted}, status=200 if deleted else 404)

    async def members(self, request: web.Request) -> web.Response:
        members = [m.to_dict() for m in self._table.members(time.monotonic())]
        return web.json_response({"version": MEMBER_VERSION, "members": members})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def expire_on_timer(self, app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(EXPIRE_INTERVAL_S)
                self.expire()
        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()


def build_app(table: MemberTable, secret: bytes | None, default_ttl_s: float = 10.0,
              names: tuple[str, ...] = ()) -> web.Application:
    """The registry's aiohttp application over ``table``; the fleet secret (None: open) guards every route
    but ``GET /health``, for requests signed to this server (``names``: the bind and advertised hosts, see
    ``bootstrap.auth.Authorities``); ``default_ttl_s`` applies to a PUT without ``ttl_s``."""
    h = _Handlers(table, default_ttl_s, secret)
    app = web.Application(middlewares=[auth_middleware(secret, names)])
    member = "/v1/members/{instance_id:.+}"
    app.add_routes([web.post(member + "/keepalive", h.keepalive), web.put(member, h.put),
                    web.delete(member, h.delete), web.get("/v1/members", h.members),
                    web.get("/health", h.health)])
    app.cleanup_ctx.append(h.expire_on_timer)
    return app


class RegistryServer:
    """The registry on its own thread and event loop (tests, or embedded in a process).

    ``start()`` binds and returns the port (``port=0``: a free one); ``stop()`` closes it and ends the thread
    (named ``membership-registry``). Nothing starts in the constructor. State lives in memory only: a
    restarted registry is empty until the members' next keepalive registers them again (within ``ttl_s / 3``).
    ``tls``: serve HTTPS with the fleet's certificate (it must name ``advertise_host``, else ``host``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 ttl_s: float = 10.0, advertise_host: str = "", tls: FleetTLS | None = None) -> None:
        self._host, self._port, self._secret, self._ttl_s = host, port, secret, ttl_s
        self._names = (host, advertise_host)
        self._advertise_host = advertise_host
        self._tls = tls
        self.table = MemberTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """``http://<advertise host>:<port>`` (``https://`` with TLS), after ``start``."""
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://{self._advertise_host or self._host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> int:
        """Raises ``MembershipError`` when the port cannot be bound within ``timeout_s`` (or the TLS files no
        longer load)."""
        ready = threading.Event()
        errors: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready, errors), name="membership-registry",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or not self.port:
            raise MembershipError(f"membership registry on {self._host}:{self._port} did not start: "
                                  f"{errors[0] if errors else 'timeout'}")
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        self._loop, self._runner, self.port = None, None, 0

    def _serve(self, ready: threading.Event, errors: list[BaseException]) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            site = _start_site(self.table, self._host, self._port, self._secret, self._ttl_s, self._names,
                               self._tls)
            self._runner = self._loop.run_until_complete(site)
            self.port = self._runner.addresses[0][1]
        except (OSError, BootstrapError) as exc:
            errors.append(exc)
        finally:
            ready.set()
        if self.port:
            self._loop.run_forever()
        self._loop.close()


async def _start_site(table: MemberTable, host: str, port: int, secret: bytes | None, ttl_s: float,
                      names: tuple[str, ...] = (), tls: FleetTLS | None = None) -> web.AppRunner:
    runner = web.AppRunner(build_app(table, secret, ttl_s, names), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=None if tls is None else tls.server_context()).start()
    return runner


def run_forever(host: str, port: int, secret: bytes | None, ttl_s: float = 10.0,
                ignore_sigint: bool = False, advertise_host: str = "", tls: FleetTLS | None = None) -> None:
    """Serves in the calling thread (``python -m bootstrap.membership``) until SIGTERM, or SIGINT unless
    ``ignore_sigint`` (a launcher's Ctrl-C reaches its whole process group: the registry should outlive the
    members that withdraw while they stop). ``advertise_host``: the name members dial it by, when not ``host``
    (signatures name the server they are for: ``bootstrap.auth.Authorities``; with ``tls``, the name its
    certificate must hold). ``tls``: serve HTTPS (``bootstrap.tls``); None: HTTP."""
    async def serve() -> None:
        runner = await _start_site(MemberTable(), host, port, secret, ttl_s, (host, advertise_host), tls)
        logger.info("membership registry on %s://%s:%d (fleet secret %s)", "http" if tls is None else "https",
                    host, runner.addresses[0][1], "required" if secret else "off: loopback only")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if ignore_sigint:
            loop.add_signal_handler(signal.SIGINT, lambda: logger.info("SIGINT ignored: stopped by SIGTERM"))
        else:
            loop.add_signal_handler(signal.SIGINT, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
