"""One PD instance's own rendezvous: an HTTP server (aiohttp) on a thread of the instance's process, around a
``Registry`` that holds this instance's registration and, on a prefill instance, the rooms posted to it.

No process of its own, so nothing central sits on a request's path: decode posts a room's destination straight
to the prefill instance's rendezvous (one HTTP call), and the prefill instance takes it in-process, woken at
once (``on_destination``). A peer fetches the registration here for its handshake and checks here that the
instance still lives (a refused connection says the process is gone). SGLang hosts its bootstrap server in the
prefill server the same way; here both roles host one, since prefill fetches decode's registration too.

Routes (every body a ``bootstrap.messages`` envelope; with a fleet secret every route but ``/health`` needs a
valid ``X-PD-Fleet-Auth`` header; with ``RendezvousConfig.tls`` it serves HTTPS, ``bootstrap.tls``):
  GET    /v1/instances                     → InstanceList (this instance, with its load: the routers' poll)
  GET    /v1/instances/{id}                → Registration (404 unless ``id`` is this instance)
  POST   /v1/rooms          Destination    → PostResult (409 room in use, 404 not this prefill instance)
  POST   /v1/rooms/release  RoomRelease    → RoomReleased
  GET    /health                           → "ok"

Threads: ``start`` runs the server's event loop on the thread ``rendezvous-<instance>``; the owner calls
``register``/``report_load``/``take_destinations``/``deregister`` from its own threads (a lock guards the
registry, which the loop's handlers take too, briefly). ``stop`` ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from bootstrap.errors import BootstrapError
from bootstrap.messages import (
    ACCEPTED,
    ROOM_IN_USE,
    Destination,
    InstanceList,
    InstanceLoad,
    Registration,
    RoomRelease,
    decode,
    encode,
)
from bootstrap.registry import Registry, RegistryConfig

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class RendezvousConfig:
    """``host``: the address the server binds (the one peers reach: the instance's advertised address);
    ``port`` 0 picks a free one. ``advertise_host``: how peers reach it (default ``host``). ``secret``: the
    fleet secret (``bootstrap.auth``); None: unauthenticated, which only a loopback bind may be. ``tls``:
    serve HTTPS with the fleet's certificate (``bootstrap.tls``; it must name the advertised host); None:
    HTTP."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    registry: RegistryConfig = RegistryConfig()
    secret: bytes | None = None
    tls: FleetTLS | None = None


def _reply(message: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(message), status=status, content_type="application/json")


class Rendezvous:
    """The server and the owner's in-process handle on its registry. Constructed cheaply; ``start`` binds."""

    def __init__(self, config: RendezvousConfig, on_destination: Callable[[], None] = lambda: None) -> None:
        """
        Args:
            config: where to listen, the registry's TTLs, the fleet secret.
            on_destination: called on the server's loop thread after a destination was accepted (the prefill
                manager sets its wake event); must be cheap and never raise.
        """
        self._config = config
        self._on_destination = on_destination
        self._registry = Registry(config.registry)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # --- the owner's side (any thread) ----------------------------------------------------------------------
    def register(self, registration: Registration) -> None:
        with self._lock:
            self._registry.register(registration, time.monotonic())

    def report_load(self, instance_id: str, epoch: int, load: InstanceLoad | None) -> bool:
        """The owner's periodic report (every 0.5 s): keeps the registration fresh and its load current. False
        when the registration is gone (it expired): the owner registers again."""
        with self._lock:
            return self._registry.heartbeat(instance_id, epoch, time.monotonic(), load)

    def take_destinations(self, prefill_instance_id: str) -> list[Destination]:
        """Every destination posted since the last call, each once (in-process: no HTTP)."""
        with self._lock:
            return self._registry.take_destinations(prefill_instance_id)

    def set_draining(self, instance_id: str, epoch: int) -> bool:
        """The owner's model is being unloaded: its listing says ``draining`` from now on (routers stop
        pairing it). False when that registration is gone."""
        with self._lock:
            return self._registry.set_draining(instance_id, epoch)

    def deregister(self, instance_id: str, epoch: int) -> None:
        with self._lock:
            self._registry.deregister(instance_id, epoch, time.monotonic())

    @property
    def url(self) -> str:
        """``http://<advertise host>:<port>`` (``https://`` with TLS), after ``start``."""
        scheme = "http" if self._config.tls is None else "https"
        return f"{scheme}://{self._config.advertise_host or self._config.host}:{self.port}"

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self, name: str = "rendezvous", timeout_s: float = 10.0) -> int:
        """Binds and serves on a new thread; returns the bound port. Raises ``BootstrapError`` when the server
        cannot start (address in use, an address this host does not have, a non-loopback bind without a
        secret, TLS files that no longer load)."""
        from bootstrap.auth import check_bind

        check_bind(self._config.host, self._config.secret, "the rendezvous")
        ready = threading.Event()
        errors: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready, errors), name=name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or not self.port:
            raise BootstrapError(f"rendezvous on {self._config.host}:{self._config.port} did not start: "
                                 f"{errors[0] if errors else f'not within {timeout_s:g} s'}")
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Idempotent: closes the server (open calls are answered first) and ends the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout_s)
            except Exception:   # best effort at shutdown: the thread is stopped below either way
                logger.warning("rendezvous cleanup failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        self._loop = self._thread = None

    def _serve(self, ready: threading.Event, errors: list[BaseException]) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = self._loop.run_until_complete(self._start_site())
            self.port = self._runner.addresses[0][1]
        except BaseException as exc:   # reported by start()
            errors.append(exc)
            ready.set()
            self._loop.close()
            return
        ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start_site(self) -> web.AppRunner:
        runner = web.AppRunner(self.build_app(), access_log=None)
        await runner.setup()
        tls = self._config.tls
        await web.TCPSite(runner, self._config.host, self._config.port,
                          ssl_context=None if tls is None else tls.server_context()).start()
        return runner

    # --- the routes (the server's loop thread) --------------------------------------------------------------
    def build_app(self) -> web.Application:
        from bootstrap.auth import auth_middleware

        names = (self._config.host, self._config.advertise_host)
        app = web.Application(middlewares=[auth_middleware(self._config.secret, names), self._map_errors])
        app.add_routes([web.get("/v1/instances", self._list),
                        web.get("/v1/instances/{instance_id}", self._get),
                        web.post("/v1/rooms", self._post_room), web.post("/v1/rooms/release", self._release),
                        web.get("/health", self._health)])
        return app

    async def _list(self, request: web.Request) -> web.Response:
        with self._lock:
            now_s = time.monotonic()
            self._registry.expire(now_s)
            return _reply(InstanceList(self._registry.instances(now_s)))

    async def _get(self, request: web.Request) -> web.Response:
        with self._lock:
            registration = self._registry.get(request.match_info["instance_id"])
        return _reply(registration) if registration else web.Response(status=404)

    async def _post_room(self, request: web.Request) -> web.Response:
        destination = decode(await request.read(), Destination)
        with self._lock:
            now_s = time.monotonic()
            self._registry.expire(now_s)
            result = self._registry.post_destination(destination, now_s)
        if result.code == ACCEPTED:
            self._on_destination()
        return _reply(result, {ACCEPTED: 200, ROOM_IN_USE: 409}.get(result.code, 404))

    async def _release(self, request: web.Request) -> web.Response:
        message = decode(await request.read(), RoomRelease)
        with self._lock:
            return _reply(self._registry.release_room(message.room, message.decode_instance_id))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def _map_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BootstrapError as exc:
            return web.Response(status=400, text=str(exc))
