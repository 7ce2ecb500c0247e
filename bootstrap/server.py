"""The bootstrap HTTP service (aiohttp): a thin shell around ``Registry``.

Routes (every body is a ``bootstrap.messages`` envelope):
  POST   /v1/instances                       Registration            → Registration
  POST   /v1/heartbeat                       Heartbeat (with load)   → Heartbeat (404: register again)
  GET    /v1/instances[?role=R]                                      → InstanceList (the fleet, with loads)
  DELETE /v1/instances/{id}?epoch=E                                  → 200 / 404
  GET    /v1/instances/{id}                                          → Registration (404: unknown)
  POST   /v1/rooms                           Destination             → PostResult (409 in use, 404 no peer)
  GET    /v1/instances/{id}/destinations                             → DestinationBatch
  POST   /v1/rooms/release                   RoomRelease             → RoomReleased
  POST   /v1/rooms/abort                     RoomAbort               → RoomAbort (appended to the abort log)
  GET    /v1/aborts?after=SEQ[&wait_s=W]                             → AbortLog (long poll: waits up to W s,
                                                                       at most MAX_ABORTS_WAIT_S, for an abort
                                                                       or a router gone)
  GET    /health                                                     → "ok"
Expiry runs on every request and on an idle timer, so silent instances drop out without new traffic.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from bootstrap.errors import BootstrapError
from bootstrap.messages import (
    ACCEPTED,
    ROOM_IN_USE,
    AbortLog,
    Destination,
    DestinationBatch,
    Heartbeat,
    InstanceList,
    Registration,
    RoomAbort,
    RoomRelease,
    decode,
    encode,
)
from bootstrap.registry import Registry, RegistryConfig

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_ABORTS_WAIT_S = 30.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8998                  # 0: pick a free port (tests)
    expire_interval_s: float = 0.5
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    ignore_sigint: bool = False       # the standalone process stops on SIGTERM only (``run_forever``)


def _reply(message: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(message), status=status, content_type="application/json")


class _Handlers:
    """One aiohttp handler per route; each decodes, asks the registry, encodes."""

    def __init__(self, registry: Registry, config: ServerConfig) -> None:
        self._registry = registry
        self._config = config
        self._abort_appended: asyncio.Event | None = None   # set (and replaced) on every abort: wakes long polls
        self._closing = False

    def _abort_event(self) -> asyncio.Event:
        if self._abort_appended is None:   # created on the server's loop, at first use
            self._abort_appended = asyncio.Event()
        return self._abort_appended

    async def register(self, request: web.Request) -> web.Response:
        registration = decode(await request.read(), Registration)
        self._registry.register(registration, time.monotonic())
        logger.info("registered %s %s epoch %d", registration.role, registration.instance_id,
                    registration.epoch)
        return _reply(registration)

    async def heartbeat(self, request: web.Request) -> web.Response:
        beat = decode(await request.read(), Heartbeat)
        known = self._registry.heartbeat(beat.instance_id, beat.epoch, time.monotonic(), beat.load)
        return _reply(beat, 200 if known else 404)

    async def deregister(self, request: web.Request) -> web.Response:
        epoch = int(request.query.get("epoch", "-1"))
        ok = self._registry.deregister(request.match_info["instance_id"], epoch, time.monotonic())
        if ok:
            self._wake_long_polls()   # a router gone is news for the workers' abort feeds
        return web.Response(status=200 if ok else 404)

    async def list_instances(self, request: web.Request) -> web.Response:
        return _reply(InstanceList(self._registry.instances(time.monotonic(), request.query.get("role", ""))))

    async def get_instance(self, request: web.Request) -> web.Response:
        registration = self._registry.get(request.match_info["instance_id"])
        return _reply(registration) if registration else web.Response(status=404)

    async def post_room(self, request: web.Request) -> web.Response:
        result = self._registry.post_destination(decode(await request.read(), Destination), time.monotonic())
        return _reply(result, {ACCEPTED: 200, ROOM_IN_USE: 409}.get(result.code, 404))

    async def destinations(self, request: web.Request) -> web.Response:
        return _reply(DestinationBatch(self._registry.take_destinations(request.match_info["instance_id"])))

    async def release(self, request: web.Request) -> web.Response:
        message = decode(await request.read(), RoomRelease)
        return _reply(self._registry.release_room(message.room, message.decode_instance_id))

    async def abort(self, request: web.Request) -> web.Response:
        message = decode(await request.read(), RoomAbort)
        self._registry.abort_room(message.room, time.monotonic())
        logger.info("room %d aborted: %s", message.room, message.reason)
        self._wake_long_polls()
        return _reply(message)

    def _wake_long_polls(self) -> None:
        appended, self._abort_appended = self._abort_event(), asyncio.Event()
        appended.set()

    async def aborts(self, request: web.Request) -> web.Response:
        """The rooms aborted after cursor ``after``; with ``wait_s`` > 0 and none yet, waits until one is
        aborted or ``wait_s`` (capped at ``MAX_ABORTS_WAIT_S``) has passed, then answers (a long poll)."""
        try:
            after = int(request.query.get("after", "-1"))
            wait_s = min(max(float(request.query.get("wait_s", "0")), 0.0), MAX_ABORTS_WAIT_S)
        except ValueError as exc:
            raise BootstrapError(f"bad query of /v1/aborts: {exc}") from exc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            appended = self._abort_event()   # taken before reading the log: no abort can slip in between
            rooms, last_seq, routers = self._registry.aborts_after(after)
            remaining_s = deadline - loop.time()
            if rooms or routers or remaining_s <= 0 or self._closing:
                return _reply(AbortLog(rooms, last_seq, routers))
            try:
                await asyncio.wait_for(appended.wait(), remaining_s)
            except asyncio.TimeoutError:
                pass

    async def end_long_polls(self, app: web.Application) -> None:
        """``on_shutdown``: held long polls answer now (aiohttp waits for open requests before it stops)."""
        self._closing = True
        self._abort_event().set()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def expire_and_map_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self._expire()
        try:
            return await handler(request)
        except BootstrapError as exc:
            return web.Response(status=400, text=str(exc))

    def _expire(self) -> None:
        dead = self._registry.expire(time.monotonic())
        for instance_id in dead:
            logger.warning("registration of %s expired (no heartbeat)", instance_id)
        if dead:
            self._wake_long_polls()

    async def expire_on_idle(self, app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self._config.expire_interval_s)
                self._expire()
        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()


def build_app(registry: Registry, config: ServerConfig) -> web.Application:
    """The aiohttp application serving ``registry``; expiry also runs on an idle timer task."""
    h = _Handlers(registry, config)
    app = web.Application(middlewares=[h.expire_and_map_errors])
    app.add_routes([web.post("/v1/instances", h.register), web.post("/v1/heartbeat", h.heartbeat),
                    web.delete("/v1/instances/{instance_id}", h.deregister),
                    web.get("/v1/instances", h.list_instances),
                    web.get("/v1/instances/{instance_id}", h.get_instance),
                    web.post("/v1/rooms", h.post_room),
                    web.get("/v1/instances/{instance_id}/destinations", h.destinations),
                    web.post("/v1/rooms/release", h.release), web.post("/v1/rooms/abort", h.abort),
                    web.get("/v1/aborts", h.aborts), web.get("/health", h.health)])
    app.cleanup_ctx.append(h.expire_on_idle)
    app.on_shutdown.append(h.end_long_polls)
    return app


class BootstrapServer:
    """Runs the service on its own thread and event loop, for tests and for embedding in a process.

    ``start()`` returns the bound port (useful with port 0); ``stop()`` shuts the loop down; neither is
    called from a constructor. The standalone process (``python -m bootstrap``) uses ``run_forever``.
    """

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self.registry = Registry(config.registry)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self, timeout_s: float = 10.0) -> int:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="bootstrap-server",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or not self.port:
            raise BootstrapError(f"bootstrap server did not start within {timeout_s}s")
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is None or self._thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._loop = None

    @property
    def url(self) -> str:
        return f"http://{self._config.host}:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = self._loop.run_until_complete(_start_site(self.registry, self._config))
            self.port = self._runner.addresses[0][1]
        finally:
            ready.set()
        self._loop.run_forever()
        self._loop.close()


async def _start_site(registry: Registry, config: ServerConfig) -> web.AppRunner:
    runner = web.AppRunner(build_app(registry, config), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    return runner


def run_forever(config: ServerConfig) -> None:
    """Serve in the calling thread (the standalone process) until SIGTERM, or SIGINT unless
    ``config.ignore_sigint``. ``scripts/serve.sh`` sets that: a Ctrl-C reaches every process of its group at
    once, and the fleet's rendezvous must outlive the models that deregister from it while they stop; serve.sh
    stops it (SIGTERM) after tritonserver."""
    async def serve() -> None:
        runner = web.AppRunner(build_app(Registry(config.registry), config), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        logger.info("======== Running on http://%s:%d ========", config.host, config.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if config.ignore_sigint:
            loop.add_signal_handler(signal.SIGINT, lambda: logger.info("SIGINT ignored: stopped by SIGTERM"))
        else:
            loop.add_signal_handler(signal.SIGINT, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
