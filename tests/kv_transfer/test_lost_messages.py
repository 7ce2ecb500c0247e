"""A message between the two sides that is lost costs time, never pages.

Seen in a full-suite run with Mooncake across network-namespace hosts (decode host's link down 5 s
mid-transfer): a decode room failed (its client cancelled), decode released it at the prefill's rendezvous and
sent its cancel, the prefill side answered ``done``, and that answer never arrived: Mooncake drops the
messages queued behind a write that failed (here the write the partition stopped, failed at
``MC_TRANSFER_TIMEOUT``). The room's 36 pages stayed held for good (a failed room waits for its writer's
answer; nothing asked again). Now decode sends its cancel again while unanswered
(``decode_side.CANCEL_RESEND_S``, doubling), and a writer that never answers within
``waiting_timeout_s`` of the first cancel is fenced and the pages go back.

Here the prefill side's transport loses messages (the network's loss, not the product's code): its ``done``
answers are dropped, the first one or all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kv_harness import PAGE_SIZE, LocalSide, SideWorker, wait_for

from kv_transfer import KVManager, KVPoll
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.tags import Tag, TagKind

TIMEOUT_S = 10.0
WAITING_TIMEOUT_S = 2.0


class LossyAnswers(InProcessTransport):
    """The in-process transport whose outgoing ``done`` messages are dropped while ``drop(n)`` says so (``n``:
    the ``done`` messages dropped so far); counts the ``cancel`` messages it receives, by room."""

    def __init__(self, instance_id: str, drop: Callable[[int], bool]) -> None:
        super().__init__(instance_id)
        self._drop = drop
        self._lock = threading.Lock()
        self.dropped = 0
        self.cancels: dict[int, int] = {}

    def send_notif(self, peer: str, notif: bytes) -> None:
        tag = Tag.decode(notif)
        if tag is not None and tag.kind == TagKind.DONE:
            with self._lock:
                if self._drop(self.dropped):
                    self.dropped += 1
                    return
        super().send_notif(peer, notif)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        notifs = super().get_notifs()
        for _, message in notifs:
            tag = Tag.decode(message)
            if tag is not None and tag.kind == TagKind.CANCEL:
                with self._lock:
                    self.cancels[tag.room] = self.cancels.get(tag.room, 0) + 1
        return notifs


def _pair(name: str, drop: Callable[[int], bool]) -> tuple[LocalSide, LossyAnswers, LocalSide]:
    timeouts = {"waiting_timeout_s": WAITING_TIMEOUT_S, "bootstrap_timeout_s": 20.0}
    prefill = LocalSide("prefill", f"prefill-{name}", "inprocess", **timeouts)
    worker: SideWorker = prefill.worker
    worker.manager.shutdown()   # never started: swap in the lossy transport
    lossy = LossyAnswers(worker.args.instance_id, drop)
    worker.manager = KVManager(worker.args, lossy)
    decode = LocalSide("decode", f"decode-{name}", "inprocess", **timeouts)
    for side in (prefill, decode):
        side.start_free = side.call("start")
        side.rendezvous_url = side.call("rendezvous_url")
    return prefill, lossy, decode


def _cancelled_mid_transfer(prefill: LocalSide, decode: LocalSide, room: int) -> None:
    """A room whose first chunk landed, then decode gave it up (its client went away)."""
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 4 * PAGE_SIZE)
    prefill.call("open_sender", room, 4 * PAGE_SIZE)
    wait_for(lambda: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S,
             "destination at prefill")
    prefill.call("send", room, 2, False)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Transferring, TIMEOUT_S, "first chunk at decode")
    decode.call("abort", room, "cancelled by the client")
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "the cancel at prefill")


def _pages_back(side: LocalSide, within_s: float) -> None:
    wait_for(lambda: side.call("reap") == side.start_free, within_s, f"{side.instance_id}'s pages back")
    wait_for(lambda: side.call("metrics")["open_rooms"] == 0, within_s, f"{side.instance_id}'s rooms closed")


def test_a_lost_answer_to_a_cancel_is_asked_for_again() -> None:
    prefill, lossy, decode = _pair("lost-done", lambda dropped: dropped == 0)
    try:
        _cancelled_mid_transfer(prefill, decode, 7001)
        _pages_back(decode, WAITING_TIMEOUT_S)   # the second cancel (1 s later) is answered: before the fence
        assert lossy.dropped == 1 and lossy.cancels[7001] >= 2, (lossy.dropped, lossy.cancels)
        assert decode.call("metrics")["fenced_rooms_total"] == 0
        _pages_back(prefill, TIMEOUT_S)
    finally:
        for side in (decode, prefill):
            side.call("stop")


def test_a_writer_that_never_answers_is_fenced_and_the_pages_go_back() -> None:
    prefill, lossy, decode = _pair("no-done", lambda dropped: True)
    try:
        _cancelled_mid_transfer(prefill, decode, 7002)
        assert decode.call("reap") < decode.start_free   # held while the writer may still write
        _pages_back(decode, WAITING_TIMEOUT_S + TIMEOUT_S)
        assert lossy.cancels[7002] >= 2, lossy.cancels   # asked again before giving up
        assert decode.call("metrics")["fenced_rooms_total"] == 1
        _pages_back(prefill, TIMEOUT_S)
    finally:
        for side in (decode, prefill):
            side.call("stop")
