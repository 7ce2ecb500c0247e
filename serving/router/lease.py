"""``RouterLease``: a router's registration at the bootstrap service, renewed by heartbeats.

Workers follow the bootstrap's abort log, which names every router whose registration expired (missed
heartbeats for ``registration_ttl_s``, 10 s by default) or was deregistered (a clean stop): they then fail
every request that router opened and free its pages. That bounds what a router that died, or lost its network,
can strand: at most the TTL, whatever happened to its gRPC streams. (A router killed outright is noticed faster
still: its gRPC streams to the children break and Triton cancels the child requests.)

Not thread-safe: called from the fleet watcher's thread (and ``start``/``stop`` of its owner).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError
from bootstrap.messages import Registration

logger = logging.getLogger(__name__)


def new_router_id(name: str) -> str:
    """A fleet-unique id for one router process: ``<name>@<host>:<pid>:<random>``."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class RouterLease:
    """``router_id`` is what children get as their ``router_id`` input. A lease the service let expire (the
    router was silent past the TTL, so workers have dropped its rooms) is never renewed under the same id:
    the router registers again under a new one, so its new requests are not mistaken for the dead lease's."""

    def __init__(self, bootstrap_url: str, name: str, address: str, model_name: str) -> None:
        """
        Args:
            bootstrap_url: the fleet's bootstrap service.
            name: prefix of the router id (the Triton instance name).
            address: the gRPC endpoint serving this router (informational).
            model_name: the router's model name (``pd_ensemble``).
        """
        self._name = name
        self._client = BootstrapClient(bootstrap_url, timeout_s=2.0)
        self._registration = self._new_registration(address, model_name)
        self._registered = False

    @property
    def router_id(self) -> str:
        return self._registration.instance_id

    def _new_registration(self, address: str, model_name: str) -> Registration:
        return Registration(new_router_id(self._name), "router", time.time_ns(), "", "", "", address=address,
                            model_name=model_name)

    def renew(self) -> None:
        """Heartbeat; register when not yet registered, under a new id when the service let the lease expire.
        Failures are logged, not raised."""
        try:
            if self._registered and not self._client.heartbeat(self.router_id, self._registration.epoch):
                old = self.router_id
                self._registration = self._new_registration(self._registration.address,
                                                            self._registration.model_name)
                self._registered = False
                logger.warning("router lease %s had expired; registering as %s", old, self.router_id)
            if not self._registered:
                self._client.register(self._registration)
                self._registered = True
        except BootstrapError as e:
            logger.warning("router lease of %s not renewed: %s", self.router_id, e)

    def release(self) -> None:
        """Deregister (workers drop this router's rooms at once); idempotent."""
        if self._registered:
            try:
                self._client.deregister(self.router_id, self._registration.epoch)
            except BootstrapError as e:
                logger.warning("router lease of %s not released: %s", self.router_id, e)
            self._registered = False
        self._client.close()
