"""Per-room poll state shared by senders and receivers, and the pace of a thread polling for a completion.

Lifecycle of a room's state (forward-only; ``Failed`` is sticky and ends only that room):

1. ``Bootstrapping``   — the peer for this room is not yet known (prefill: no destination yet;
                          decode: handshake with the prefill instance or destination not yet published).
2. ``WaitingForInput`` — both sides know each other; prefill may run and call ``send``.
3. ``Transferring``    — at least one chunk has been posted (prefill) or has arrived (decode).
4. ``Success``         — every chunk and the aux data have been written and confirmed.
0. ``Failed``          — reachable from any non-terminal state; never left again.
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    """Ordered poll state of one room; compare with ``<``/``>=`` to ask "at least"."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


def advance(current: KVPoll, target: KVPoll) -> KVPoll:
    """The one transition function: returns the state after asking to move from ``current`` to ``target``.

    Moves only forward; ``Failed`` and ``Success`` are terminal (a request to fail a finished room, or to
    move a failed room on, is ignored). Any non-terminal state may fail.
    """
    if current.is_terminal:
        return current
    if target == KVPoll.Failed:
        return KVPoll.Failed
    return max(current, target)


#: ``poll_interval_s``: this fraction of the time waited so far, within ``[POLL_MIN_S, POLL_MAX_S]``.
POLL_FRACTION = 0.05
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3


def poll_interval_s(waited_s: float) -> float:
    """How long a thread that polls for a completion sleeps after waiting ``waited_s`` seconds: 5 % of it,
    50 us to 1 ms, so the completion is seen at most ~5 % late and never more than 1 ms late, and a long wait
    costs ~1,000 polls a second, not 20,000. Callers: the Mooncake writer threads polling their pieces
    (``mooncake_transport``), the fleet harness's KV workers (``scripts/fleet/kv_worker.py``). A 50 us poll
    throughout took CPU from Mooncake's I/O threads on 2 cores (docs/multihost.md, "The decode side's
    pace")."""
    return min(POLL_MAX_S, max(POLL_MIN_S, waited_s * POLL_FRACTION))
