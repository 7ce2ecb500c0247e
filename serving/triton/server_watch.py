"""``ServerShutdownWatch``: notice that this model's tritonserver is shutting down, before ``finalize``.

tritonserver 2.51 calls a model's ``finalize`` only after the model's live requests ended, and waits for them
at most ``--exit-timeout-secs``, then exits under them; a decoupled request of an engine ends only when the
engine ends it, and requests that came past tritonserver (a worker's own endpoint) it does not see at all. So
the model must know when the stop began: to drain (the router admits nothing more, a worker leaves the fleet;
what is in flight runs on) and to end what is left before the exit timeout
(``serving.triton.host.ModelHost.on_server_stop``). The watch asks the server's own gRPC endpoint whether it
is *live*, every ``interval_s`` (0.5 s); once it has been live, an answer ``UNAVAILABLE: Server exiting``
(what tritonserver says from the first moment of its stop) means the server is going down at once, and so do
two consecutive failed checks of another kind (unreachable: the endpoint is gone); ``on_shutdown`` then runs
once, on the watch's thread.

tritonserver 2.51's own order on SIGTERM (``src/main.cc``, r24.10): its HTTP service stops taking connections
and waits for the open ones (up to the exit timeout, which that wait uses up); then the server stops (liveness
says "Server exiting", readiness false, every model refuses new requests), waits for the requests in flight
and unloads the models; its gRPC service stops last. So the watch, on gRPC, sees the stop as it begins for the
models.

Why liveness and not readiness: tritonserver 2.51 answers liveness with ``UNAVAILABLE: Server exiting`` from
the moment its stop begins (``InferenceServer::IsLive``, r24.10 core), and with "live" at every other time
after start-up. Readiness is strict by default: "not ready" while *any* model of the server loads or unloads
(an operator's ``POST /v2/repository/models/<m>/load``), which is no shutdown: a watch on readiness ended the
router and the decode loop at every model reload. A model's own unload is not a shutdown either: it ends with
the model's ``finalize``.

With a model and ``on_unload``, the watch also asks whether the model is ready while the server is live: a
model that read ready and then reads not ready (twice in a row) is being unloaded while this instance still
runs, so tritonserver has not called its ``finalize`` yet: it waits for the model's requests, or something
holds the model (tritonserver 2.51 keeps a model whose stream a client cancelled as its FINAL went out:
docs/healing.md, "Unloads"). ``on_unload`` runs once (the adapter drains, then stops serving), so an unload
takes effect within the drain timeout whatever holds the model.

Thread ``server-watch-<name>``, started by ``start``, stopped and joined by ``stop`` (in ``finalize``, first).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)


class ServerShutdownWatch:
    def __init__(self, name: str, grpc_url: str, on_shutdown: Callable[[], None], interval_s: float = 0.5,
                 timeout_s: float = 2.0, misses: int = 2, is_live: Callable[[], bool] | None = None,
                 tls: GrpcTls | None = None, model: str = "", on_unload: Callable[[], None] | None = None,
                 is_model_ready: Callable[[], bool] | None = None) -> None:
        """
        Args:
            name: thread name suffix (the model instance).
            grpc_url: ``host:port`` of this server's gRPC endpoint (``WorkerConfig.grpc_url``).
            on_shutdown: called once, on the watch thread, when the server is going down.
            interval_s: seconds between two liveness checks.
            timeout_s: timeout of one check, seconds.
            misses: consecutive failed checks (after one success) that mean shutdown; one check answered
                "Server exiting" is enough.
            is_live: the check (raises when the server cannot be reached or answers an error, as it does
                while exiting); default: tritonclient's ``is_server_live`` on ``grpc_url``.
            tls: TLS of that check's channel (a server with ``--grpc-use-ssl``); None: plaintext.
            model: this instance's model; with ``on_unload``, its readiness is checked too while the server is
                live.
            on_unload: called once, on the watch thread, when the model has read not ready for ``misses``
                consecutive checks after it read ready while the server stays live: it is being unloaded, and
                tritonserver has not finalized this instance (it waits for the model's requests, or something
                holds the model: docs/healing.md, "Unloads").
            is_model_ready: the model's check (False, or raises: not ready); default: tritonclient's
                ``is_model_ready`` of ``model`` on ``grpc_url``.
        """
        self._name = name
        self._url = grpc_url
        self._is_live = is_live
        self._tls = tls
        self._on_shutdown = on_shutdown
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._misses = misses
        self._model = model
        self._on_unload = on_unload
        self._is_model_ready = is_model_ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"server-watch-{name}", daemon=True)

    def start(self) -> ServerShutdownWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop checking; waits up to ``timeout_s`` for the thread (and an ``on_shutdown`` under way) to
        end."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        client: Any = None
        if self._is_live is None:
            from serving.triton.control_client import control_client

            client = control_client(self._url, self._tls)
            self._is_live = lambda: bool(client.is_server_live(client_timeout=self._timeout_s))
        if self._is_model_ready is None and self._on_unload is not None:
            if client is None:
                from serving.triton.control_client import control_client

                client = control_client(self._url, self._tls)
            self._is_model_ready = lambda: bool(client.is_model_ready(self._model,
                                                                      client_timeout=self._timeout_s))
        seen_live, missed = False, 0
        unload = _UnloadCheck(self._misses)
        try:
            while not self._stop.wait(self._interval_s):
                exiting = False
                try:
                    live = self._is_live()
                except Exception as e:   # "Server exiting", or unreachable: at the end the endpoint goes
                    live, exiting = False, "exiting" in str(e).lower()
                if live:
                    seen_live, missed = True, 0
                    if self._on_unload is not None and unload.unloaded(self._model_ready()):
                        logger.warning("%s: tritonserver reports %s not ready while this instance runs: it "
                                       "is being unloaded; draining", self._name, self._model)
                        self._on_unload()
                    continue
                missed += 1
                if seen_live and (exiting or missed >= self._misses):
                    logger.warning("%s: tritonserver at %s is shutting down; draining", self._name, self._url)
                    self._on_shutdown()
                    return
        except Exception:
            logger.exception("%s: server watch failed", self._name)
        finally:
            if client is not None:
                client.close()

    def _model_ready(self) -> bool:
        assert self._is_model_ready is not None
        try:
            return self._is_model_ready()
        except Exception:   # an unknown model (unloaded) answers an error
            return False


class _UnloadCheck:
    """Whether a model that read ready has now read not ready ``misses`` times in a row; says so once."""

    def __init__(self, misses: int) -> None:
        self._misses = misses
        self._seen_ready = False
        self._not_ready = 0
        self._said = False

    def unloaded(self, ready: bool) -> bool:
        if ready:
            self._seen_ready, self._not_ready = True, 0
            return False
        self._not_ready += 1
        if self._said or not self._seen_ready or self._not_ready < self._misses:
            return False
        self._said = True
        return True
