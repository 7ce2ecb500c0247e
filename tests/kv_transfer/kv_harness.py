"""Two-sided test harness: an engine-like side (KV pool in the SmolLM2 layout, a page allocator, a manager),
driven directly (in-process backend) or from a real OS process over a pipe (NIXL backend).

Every prefill page is filled with a pattern derived from (room, page index in the prompt); the decode side
checks every byte of every destination page against it, and that pages it does not own still hold the
sentinel.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_transfer import AuxData, KVArgs, KVLayout, KVPoll, make_kv_manager
from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.blocks import BlockTable
from kv_transfer.errors import TransferError

PAGE_SIZE = 16
NUM_PAGES = 48
SENTINEL = -1.0
MODEL_ID = "smollm2-135m-instruct"


def smollm2_layout(num_pages: int = NUM_PAGES, **changes: Any) -> KVLayout:
    fields: dict[str, Any] = {"num_layers": 30, "num_pages": num_pages, "page_size": PAGE_SIZE,
                              "num_kv_heads": 3, "head_dim": 64}
    fields.update(changes)
    return KVLayout(**fields)  # type: ignore[arg-type]


def host_side(num_pages: int, fill: float, aux_slots: int = 2) -> tuple[np.ndarray, np.ndarray, BlockTable]:
    """A transport's memory without a manager: a float32 pool of ``num_pages`` SmolLM2 pages filled with
    ``fill``, ``aux_slots`` aux slots filled with ``int(fill)``, and their ``BlockTable``. The arrays must
    outlive every transport that registers the table."""
    layout = smollm2_layout(num_pages=num_pages)
    pool = np.full(layout.pool_bytes // 4, fill, dtype=np.float32)
    aux = np.full(aux_slots * AUX_SLOT_BYTES, int(fill), dtype=np.uint8)
    return pool, aux, BlockTable(pool.ctypes.data, layout, aux.ctypes.data, aux_slots)


def page_pattern(room: int, index: int) -> np.ndarray:
    """Content of prompt page ``index`` of ``room``: float32 [kv_heads, layers, 2, page_size, head_dim]."""
    rng = np.random.default_rng((room % 2**32, index))
    return rng.standard_normal((3, 30, 2, PAGE_SIZE, 64), dtype=np.float32)


def cached_pattern(room: int, index: int) -> np.ndarray:
    """Content of decode's own cached page ``index`` of ``room`` (differs from every ``page_pattern``)."""
    return np.full((3, 30, 2, PAGE_SIZE, 64), 1000.0 + index + (room % 1000) / 1000, dtype=np.float32)


class PageAllocator:
    """The smallest free-list allocator: what "free-page count" means in these tests."""

    def __init__(self, num_pages: int) -> None:
        self._free = list(range(num_pages))

    def alloc(self, n: int, scatter: bool = False) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of pages: want {n}, have {len(self._free)}")
        pages = self._free[-n:][::-1] if scatter else self._free[:n]
        self._free = [p for p in self._free if p not in set(pages)]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
        self._free.sort()

    @property
    def num_free(self) -> int:
        return len(self._free)


class SideWorker:
    """One engine-like instance. Methods take and return plain data so they can be called over a pipe."""

    def __init__(self, role: str, instance_id: str, backend: str, **kv_overrides: Any) -> None:
        layout = kv_overrides.pop("layout", smollm2_layout())
        # [num_pages, num_kv_heads, num_layers, 2, page_size, head_dim] (page-major, head-major inside a
        # page), float32, host; touched
        self.pool = np.full((layout.num_pages, layout.num_kv_heads, layout.num_layers, 2, layout.page_size,
                             layout.head_dim), SENTINEL, dtype=np.float32)
        self.pages = PageAllocator(layout.num_pages)
        params: dict[str, Any] = {"bootstrap_timeout_s": 2.0, "waiting_timeout_s": 2.0,
                                  "heartbeat_interval_s": 0.2, "peer_check_interval_s": 0.2,
                                  "peer_lost_s": 1.0,
                                  "http_timeout_s": 1.0}
        params.update(kv_overrides)
        self.args = KVArgs(instance_id=instance_id, role=role, kv_base_ptr=self.pool.ctypes.data,
                           kv_nbytes=self.pool.nbytes, layout=layout,
                           model_id=params.pop("model_id", MODEL_ID), **params)
        self.manager = make_kv_manager(self.args, backend)
        self.rooms: dict[int, tuple[Any, list[int]]] = {}   # room → (sender or receiver, pages)
        self.sent_pages: dict[int, int] = {}
        self.cached_pages: dict[int, int] = {}   # decode: room → leading pages standing for its prefix cache
        self.num_tokens: dict[int, int] = {}     # decode: room → prompt tokens

    def start(self) -> int:
        self.manager.start()
        return self.pages.num_free

    def rendezvous_url(self) -> str:
        return self.manager.rendezvous_url

    def stop(self) -> None:
        self.manager.shutdown()

    def crash(self) -> None:
        """In-process stand-in for a killed process: the agent and the rendezvous vanish, nobody is told."""
        self.manager._stop.set()
        self.manager._transport.close()
        self.manager._rendezvous.stop()

    # --- prefill ------------------------------------------------------------------------------------------
    def open_sender(self, room: int, num_tokens: int, scatter: bool = False) -> None:
        sender = self.manager.create_sender(room)
        pages = self.pages.alloc(-(-num_tokens // PAGE_SIZE), scatter)
        for index, page in enumerate(pages):
            self.pool[page] = page_pattern(room, index)
        self.rooms[room] = (sender, pages)
        self.sent_pages[room] = 0
        if sender.poll() != KVPoll.Failed:
            try:
                sender.init(len(pages), num_tokens)
            except TransferError:   # the destination came first and does not fit: the room is Failed
                pass

    def send(self, room: int, num_pages: int, is_last: bool, first_token_id: int = 7,
             aux_room: int | None = None) -> bool:
        """Sends the next ``num_pages`` pages (the last chunk with aux data naming ``aux_room``, default
        ``room``); returns whether the chunk's WRITE had been posted when ``send`` returned (inline
        progress)."""
        sender, pages = self.rooms[room]
        start = self.sent_pages[room]
        self.sent_pages[room] = start + num_pages
        aux = AuxData(first_token_id, -0.25, room if aux_room is None else aux_room) if is_last else None
        sender.send(pages[start:start + num_pages], is_last, aux)
        return sender.timings.posted_s is not None

    def abort(self, room: int, reason: str = "test") -> None:
        self.rooms[room][0].abort(reason)

    # --- decode -------------------------------------------------------------------------------------------
    def open_receiver(self, room: int, prefill_id: str, prefill_url: str, num_tokens: int,
                      scatter: bool = False,
                      cached_tokens: int = 0, claim_cached_tokens: int | None = None) -> None:
        """Reserves the room's pages. The first ``cached_tokens // PAGE_SIZE`` stand for decode's prefix
        cache: filled with ``cached_pattern`` and not given to the receiver, which is told
        ``claim_cached_tokens`` (default ``cached_tokens``) leading tokens are cached."""
        receiver = self.manager.create_receiver(room, prefill_id, prefill_url)
        pages = self.pages.alloc(-(-num_tokens // PAGE_SIZE), scatter)
        skip = cached_tokens // PAGE_SIZE
        for index, page in enumerate(pages[:skip]):
            self.pool[page] = cached_pattern(room, index)
        self.rooms[room] = (receiver, pages)
        self.cached_pages[room] = skip
        self.num_tokens[room] = num_tokens
        if receiver.poll() != KVPoll.Failed:
            receiver.init(pages[skip:], cached_tokens if claim_cached_tokens is None else claim_cached_tokens)

    def check_bytes(self, room: int) -> bool:
        """Every destination page holds exactly the prefill pattern (a partly filled last page: in its filled
        token slots, the others still the sentinel: nothing but the prompt's KV was written); decode's own
        cached pages hold theirs."""
        _, pages = self.rooms[room]
        skip = self.cached_pages.get(room, 0)
        filled = self.num_tokens[room] - (len(pages) - 1) * PAGE_SIZE
        for i, page in enumerate(pages):
            want = cached_pattern(room, i) if i < skip else page_pattern(room, i)
            if i == len(pages) - 1 and i >= skip and filled < PAGE_SIZE:
                got = self.pool[page]
                if not (np.array_equal(got[..., :filled, :], want[..., :filled, :])
                        and (got[..., filled:, :] == SENTINEL).all()):
                    return False
            elif not np.array_equal(self.pool[page], want):
                return False
        return True

    def page_landed(self, room: int, index: int) -> bool:
        """Decode: destination page ``index`` of ``room`` holds the prefill pattern of that prompt page (a
        read of this process's pool only: no call into the KV manager)."""
        return bool(np.array_equal(self.pool[self.rooms[room][1][index]], page_pattern(room, index)))

    def aux(self, room: int) -> tuple[int, float, int] | None:
        aux = self.rooms[room][0].aux
        return (aux.first_token_id, aux.first_logprob, aux.room) if aux else None

    # --- both ---------------------------------------------------------------------------------------------
    def poll(self, room: int) -> int:
        return int(self.rooms[room][0].poll())

    def failure(self, room: int) -> str:
        failure = self.rooms[room][0].failure
        return failure.reason if failure else ""

    def reap(self) -> int:
        """Frees the pages of every room whose handle says they are releasable; returns the free-page
        count."""
        for room, (handle, pages) in list(self.rooms.items()):
            if handle.poll().is_terminal and handle.pages_releasable():
                self.pool[pages] = SENTINEL
                self.pages.free(pages)
                del self.rooms[room]
        return self.pages.num_free

    def untouched(self) -> bool:
        """Pages owned by no room still hold the sentinel (no stray write landed)."""
        owned = {p for _, pages in self.rooms.values() for p in pages}
        free = [p for p in range(self.pool.shape[0]) if p not in owned]
        return bool((self.pool[free] == SENTINEL).all())

    def metrics(self) -> dict[str, int]:
        return self.manager.metrics()

    def fence_writer(self, room: int) -> tuple[int, bool, int]:
        """Decode: fences the connections of ``room``'s writer (``Transport.fence_incoming``, what the manager
        does for a room whose write failed); (connections from its host before, the answer, after)."""
        from kv_transfer import tcp_fence

        receiver = self.rooms[room][0]
        transport = self.manager._transport._inner   # the backend's transport under LockedTransport
        ports = transport._data_ports
        count = lambda: len(tcp_fence._accepted_from(ports, {"127.0.0.1"}))   # noqa: E731
        before = count()
        fenced = self.manager._transport.fence_incoming(receiver.peer.agent_name)
        return before, fenced, count()


class LocalSide:
    """Calls a ``SideWorker`` in this process (in-process backend)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.worker = SideWorker(*args, **kwargs)
        self.instance_id: str = args[1]
        self.start_free = 0   # set by the fixture from ``start()``
        self.rendezvous_url = ""   # set by the fixture after ``start()``

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def kill(self) -> None:
        self.worker.crash()


def _serve(conn: Any, args: tuple, kwargs: dict) -> None:  # type: ignore[type-arg]
    worker = SideWorker(*args, **kwargs)
    while True:
        method, call_args = conn.recv()
        try:
            conn.send(("ok", getattr(worker, method)(*call_args)))
        except Exception:  # noqa: BLE001 — the test process gets the traceback
            conn.send(("err", traceback.format_exc()))
        if method == "stop":
            return


class RemoteSide:
    """A ``SideWorker`` in its own OS process (spawned); every call waits at most ``timeout_s``."""

    def __init__(self, *args: Any, timeout_s: float = 30.0, **kwargs: Any) -> None:
        self.instance_id: str = args[1]
        self.start_free = 0   # set by the fixture from ``start()``
        self.rendezvous_url = ""   # set by the fixture after ``start()``
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout_s = timeout_s
        self.process = ctx.Process(target=_serve, args=(child, args, kwargs), daemon=True)
        self.process.start()

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(self._timeout_s):
            raise TimeoutError(f"{method} did not answer within {self._timeout_s}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("stop")
            except (TimeoutError, RuntimeError, OSError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)
