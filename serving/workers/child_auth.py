"""``ChildAuth``: a PD worker's check of its child requests' fleet signatures, one per worker, shared by both
paths into it (its own endpoint, ``serving.workers.endpoint``, and tritonserver, ``serving.triton.pd_model``).

With a fleet secret, a child request is served only when it carries a signature (``signing.sign_call``)
valid for this instance's id and for this request (its model name, request id and every input: another prompt
or another model fails it), fresh (30 s) and never seen before on either path (one
``bootstrap.auth.ReplayGuard``). Anything else is refused with ``ChildUnauthenticated`` before the request is
parsed and before any engine, KV or rendezvous work. Without a secret (every server on loopback) every request
passes.

Threads: ``check`` is called from Triton's execute thread and the endpoint's event loop thread at once; it is
thread-safe (the replay guard holds a lock) and costs one SHA-256 over the request's inputs and two HMACs
(``scripts/bench_fleet_auth.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from bootstrap.auth import DEFAULT_MAX_SKEW_S, AuthError, ReplayGuard
from serving.child.signing import ChildUnauthenticated, verify_call


class ChildAuth:
    """The signature check of one worker's child requests (module docstring).

    Args:
        secret: the fleet secret; None: no check (loopback-only fleets).
        instance_id: this worker's instance id, ``<model>@<grpc host:port>`` (the authority routers sign).
        clock: unix seconds (tests move it); a signature's timestamp may be ``DEFAULT_MAX_SKEW_S`` (30 s)
            away from it.
    """

    def __init__(self, secret: bytes | None, instance_id: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.instance_id = instance_id
        self._clock = clock
        self._guard = ReplayGuard(DEFAULT_MAX_SKEW_S)

    def check(self, signature: str | None, model_name: str, request_id: str,
              inputs: Mapping[str, np.ndarray]) -> None:
        """Admits one child request, or raises ``ChildUnauthenticated`` (``"unauthenticated child request:
        <reason>"``: missing, malformed, stale, replayed, or signed for another instance or another request).

        Args:
            signature: the ``X-PD-Fleet-Auth`` value the request carries (None or "": none).
            model_name: the model the request names.
            request_id: its request id.
            inputs: every input it carries, as numpy arrays by name (``BYTES`` as object arrays of bytes).
        """
        if self.secret is None:
            return
        now = self._clock()
        try:
            verify_call(self.secret, self.instance_id, model_name, request_id, inputs, signature, now)
            self._guard.admit(signature or "", now)
        except (AuthError, ValueError) as e:
            raise ChildUnauthenticated(f"unauthenticated child request: {e}") from None


#: The check of a worker without a fleet secret: every request passes.
NO_AUTH = ChildAuth(None, "")
