"""``ServerShutdownWatch``: notice that this model's tritonserver is shutting down, before ``finalize``.

tritonserver 2.51 calls a model's ``finalize`` only after the model's live requests ended, and waits for them at
most ``--exit-timeout-secs``; a decoupled request of an engine ends only when the engine ends it. Left alone, a
long request in flight at a server stop kept the server waiting until the timeout, then lost its FINAL. The
watch asks the server's own gRPC endpoint whether it is *live*, once a second; once it has been live, two
consecutive answers of "not live" or "unreachable" mean the server is going down, and ``on_shutdown`` runs once
(the adapter stops its worker: every request in flight ends with an error and FINAL, and the server can unload
the model at once).

Why liveness and not readiness: tritonserver 2.51 answers liveness with ``UNAVAILABLE: Server exiting`` from the
moment its stop begins (``InferenceServer::IsLive``, r24.10 core), and with "live" at every other time after
start-up. Readiness is strict by default: "not ready" while *any* model of the server loads or unloads (an
operator's ``POST /v2/repository/models/<m>/load``), which is no shutdown: a watch on readiness ended the router
and the decode loop at every model reload. A model's own unload is not a shutdown either: it ends with the
model's ``finalize``.

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
    def __init__(self, name: str, grpc_url: str, on_shutdown: Callable[[], None], interval_s: float = 1.0,
                 timeout_s: float = 2.0, misses: int = 2, is_live: Callable[[], bool] | None = None,
                 tls: GrpcTls | None = None) -> None:
        """
        Args:
            name: thread name suffix (the model instance).
            grpc_url: ``host:port`` of this server's gRPC endpoint (``WorkerConfig.grpc_url``).
            on_shutdown: called once, on the watch thread, when the server is going down.
            interval_s: seconds between two liveness checks.
            timeout_s: timeout of one check, seconds.
            misses: consecutive failed checks (after one success) that mean shutdown.
            is_live: the check (raises when the server cannot be reached or answers an error, as it does
                while exiting); default: tritonclient's ``is_server_live`` on ``grpc_url``.
            tls: TLS of that check's channel (a server with ``--grpc-use-ssl``); None: plaintext.
        """
        self._name = name
        self._url = grpc_url
        self._is_live = is_live
        self._tls = tls
        self._on_shutdown = on_shutdown
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._misses = misses
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"server-watch-{name}", daemon=True)

    def start(self) -> ServerShutdownWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        client: Any = None
        if self._is_live is None:
            from serving.triton.control_client import control_client

            client = control_client(self._url, self._tls)
            self._is_live = lambda: bool(client.is_server_live(client_timeout=self._timeout_s))
        seen_live, missed = False, 0
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    live = self._is_live()
                except Exception:   # "Server exiting", or unreachable: at shutdown the endpoint goes away
                    live = False
                if live:
                    seen_live, missed = True, 0
                    continue
                missed += 1
                if seen_live and missed >= self._misses:
                    logger.warning("%s: tritonserver at %s is shutting down; ending the requests in flight",
                                   self._name, self._url)
                    self._on_shutdown()
                    return
        except Exception:
            logger.exception("%s: server watch failed", self._name)
        finally:
            if client is not None:
                client.close()
