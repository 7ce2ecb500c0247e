"""Per-room timestamps (``time.monotonic()`` seconds, shared by the processes of one host), for latency
breakdowns: where the time between ``send(is_last=True)`` and the decode side's ``Success`` goes.

Written by the manager thread (and ``send``) under the manager lock; read through ``KVSender.timings`` /
``KVReceiver.timings``, which return a copy. ``None``: the room has not reached that point (yet).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SenderTimings:
    send_s: float | None = None          # the last ``send`` call (the caller's thread)
    post_start_s: float | None = None    # the manager thread starts posting the last chunk's WRITE
    posted_s: float | None = None        # ``transfer()`` of that WRITE returned (UCX cma copies inside it)
    done_s: float | None = None          # every WRITE confirmed done: the sender's Success


@dataclass
class ReceiverTimings:
    notified_s: float | None = None      # the manager thread read the last chunk's notification
    success_s: float | None = None       # ... and moved the room to Success (aux checked)
