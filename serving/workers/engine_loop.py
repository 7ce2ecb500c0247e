"""``EngineLoop``: one engine driven by one named thread, fed through a queue.

Every engine call happens on the loop thread; other threads talk to it with ``submit``, ``abort`` and
``call_soon``, which only enqueue. One tick of the loop:

1. wait for commands: not at all when the engine has work, up to ``busy_wait_s`` while a tick hook reports
   work in flight, else up to ``idle_wait_s`` (an idle loop sleeps on its queue, it never spins);
2. run the queued commands in order (new requests join the continuous batch here, between two steps);
3. run one ``engine.step()`` when the engine has unfinished requests, and hand each output to its request's
   callback;
4. call every tick hook (``TickHook.on_tick``): cancellation checks, KV-transfer polling, metrics (fresh
   after the step).

Each submitted request gets exactly one terminal event: a finished ``RequestOutput``, or a ``RequestFailed``
(rejected by the engine, aborted, engine step error, loop stopped). Callbacks run on the loop thread and must
be quick; an exception in one is logged and aborts that request only.

Priority (``nice``): the loop thread can run at a higher priority than the rest of the process and of the
machine (Linux ``setpriority`` on that thread alone, set as it starts). The engine step is what every stream
waits for, while a server's other threads (the response thread, tritonserver's gRPC threads, a client on the
same host) each wake thousands of times a second: at equal priority the scheduler lets each wake-up preempt
the step it lands beside. Measured on a 2-core host (``scripts/bench_serving_path.py``, ``colocated``
streaming 32 x 128 tokens of a tiny model, 6 runs each, alternating): nice -10 against 0, 4457-4828 against
3624-3827 tokens/s (docs/benchmarks.md, "Serving path (tiny model)"). A nice below the process's own needs
``CAP_SYS_NICE``; without it the thread keeps the process's priority and the loop says so once in the log.

Shutdown (``stop``): set the stop event, wake the thread, join it with a deadline; on its way out the thread
aborts every request still in flight and fails every queued submit with ``LoopStopped``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import EngineError, RequestRejected, TensorParallelError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.events import LoopEvent, LoopStopped, OnEvent, RequestAborted, RequestFailed, RequestId

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """The part of ``engine.LLMEngine`` the loop drives (all calls on the loop thread)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resumed_output_ids: Iterable[int] = (), dp_rank: int | None = None) -> None: ...

    def prepare_request(self, params: SamplingParams) -> None:
        """Any thread: compile ``params.structured`` (raises ``InvalidSamplingParams``); called only when
        set."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...


class PagedEngineCore(EngineCore, Protocol):
    """An ``EngineCore`` that also reports its KV pool's pages (read on the loop thread)."""

    @property
    def num_free_pages(self) -> int: ...

    @property
    def num_total_pages(self) -> int: ...

    @property
    def rank_free_pages(self) -> list[int]:
        """A DP-attention engine's free pages per rank (``LLMEngine.rank_free_pages``); [] for one pool."""
        ...

    def dp_rank_of(self, request_id: str) -> int | None:
        """The DP-attention rank a live request runs on (``LLMEngine.dp_rank_of``); None: unknown, finished,
        or no DP attention."""
        ...


class TickHook(Protocol):
    """Work done on the loop thread once per tick, after the engine step (may call the engine)."""

    def on_tick(self) -> bool:
        """Do this tick's share of work; return True while work is in flight that needs polling soon."""
        ...


@dataclass(frozen=True)
class LoopStats:
    """A snapshot of the loop's counters (read on the loop thread, e.g. by a metrics hook)."""

    num_active_requests: int
    num_queued_commands: int
    steps_total: int
    step_seconds_total: float


@dataclass(frozen=True)
class _Submit:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    on_event: OnEvent
    resumed_output_ids: tuple[int, ...] = ()
    dp_rank: int | None = None


_Command = _Submit | Callable[[], None] | None  # None only wakes the thread


class EngineLoop:
    """Owns an engine and the thread that steps it. The constructor starts nothing."""

    def __init__(self, engine: EngineCore, name: str = "engine-loop", idle_wait_s: float = 0.1,
                 busy_wait_s: float = 0.002, hooks: Sequence[TickHook] = (), nice: int | None = None,
                 on_fatal: Callable[[EngineError], None] | None = None) -> None:
        """
        Args:
            engine: the engine; only the loop thread calls it once ``start`` returned.
            name: the thread's name (shows in logs and ``py-spy``).
            idle_wait_s: longest block on the input queue when there is nothing to do, seconds.
            busy_wait_s: block on the input queue while only tick hooks have work in flight, seconds.
            hooks: tick hooks, called in order; more can be added with ``add_hook`` before ``start``.
            nice: the loop thread's nice value, -20..19 (``set_thread_nice``, applied by the thread as it
                starts: torch's intra-op threads, which the loop thread starts, inherit it); None: the thread
                keeps the priority of the thread that calls ``start``.
            on_fatal: called once, on the loop thread, after a step failed with an error that ends the engine
                for good (``TensorParallelError``: a rank died or hung) and every request in flight was failed
                with it; a Triton instance passes ``serving.workers.fatal.exit_process_soon`` so that it ends
                as a dead stub does (its server is replaced). None: the engine stays up, failing every
                request.
        """
        self.engine = engine
        self._name = name
        self._nice = nice
        self._idle_wait_s = idle_wait_s
        self._busy_wait_s = busy_wait_s
        self._hooks: list[TickHook] = list(hooks)
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._callbacks: dict[RequestId, OnEvent] = {}
        # submitted, not added yet (still in the queue) → how many; an abort meeting one of them is kept in
        # ``_abort_on_add`` until the submit comes off the queue (a tick hook's abort, same tick as its
        # submit)
        self._queued_submits: dict[RequestId, int] = {}
        self._abort_on_add: dict[RequestId, str] = {}
        self._submits_lock = threading.Lock()
        self._stop = threading.Event()
        self._accept_lock = threading.Lock()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._hooks_busy = False
        self._steps_total = 0
        self._step_seconds_total = 0.0
        self._on_fatal = on_fatal
        self._fatal_reported = False

    # ---- any thread ----------------------------------------------------------------------------------------
    def add_hook(self, hook: TickHook) -> None:
        """Register a tick hook. Raises RuntimeError once the loop was started."""
        if self._thread is not None:
            raise RuntimeError("add hooks before start()")
        self._hooks.append(hook)

    def start(self) -> None:
        """Start the loop thread. Raises RuntimeError when called twice."""
        if self._thread is not None:
            raise RuntimeError(f"{self._name} already started")
        with self._accept_lock:
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        logger.info("%s started", self._name)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread, aborting every request in flight; returns False if it did not exit in
        ``timeout_s``."""
        self._stop.set()
        self._commands.put(None)
        if self._thread is None:
            self._shutdown()
            return True
        self._thread.join(timeout_s)
        alive = self._thread.is_alive()
        if alive:
            logger.error("%s did not stop within %.1f s", self._name, timeout_s)
        return not alive

    @property
    def native_id(self) -> int | None:
        """The loop thread's kernel thread id (``/proc/<pid>/task/<id>``); None before ``start``."""
        return None if self._thread is None else self._thread.native_id

    @property
    def running(self) -> bool:
        """True between ``start`` and the end of ``stop``."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams,
               on_event: OnEvent, resumed_output_ids: tuple[int, ...] = (),
               dp_rank: int | None = None) -> None:
        """Queue a new request; it joins the batch before the next step.

        ``resumed_output_ids``: tokens the request already generated and sent elsewhere (a migrated request;
        ``LLMEngine.add_request``); its outputs carry only what follows them. ``dp_rank``: the DP-attention
        rank that runs it (None: the engine places it).

        ``on_event`` is called on the loop thread with each ``RequestOutput`` and exactly one terminal event.
        Engine rejections (``RequestRejected``, a duplicate id) arrive there as ``RequestFailed``.

        Raises:
            LoopStopped: the loop is not running; ``on_event`` will never be called.
        """
        with self._submits_lock:
            self._queued_submits[request_id] = self._queued_submits.get(request_id, 0) + 1
        try:
            self._put(_Submit(request_id, list(prompt_token_ids), params, on_event,
                              tuple(resumed_output_ids), dp_rank))
        except LoopStopped:
            self._unqueue(request_id)
            raise

    def prepare(self, params: SamplingParams) -> None:
        """Caller's thread (admission): compile the request's structured-outputs grammar now, so the loop
        thread finds it compiled and a slow or bad spec holds up only its own request. No-op without one.

        Raises:
            InvalidSamplingParams: the spec cannot be compiled for this model's vocabulary (naming its field).
        """
        if params.structured is not None:
            self.engine.prepare_request(params)

    def abort(self, request_id: RequestId, reason: str = "aborted by caller") -> None:
        """Queue an abort: the engine frees the request's pages and its callback gets ``RequestAborted``.

        Called on the loop thread (a tick hook), it takes effect at once; from elsewhere, before the next
        step. A request still queued (submitted, not added yet: a tick hook that submits and aborts in one
        tick) is aborted when it comes off the queue, without reaching the engine. A request that already
        finished (or is unknown) is left alone.

        Raises:
            LoopStopped: called from another thread when the loop is not running (nothing left to abort).
        """
        if threading.current_thread() is self._thread:
            self._abort(request_id, reason)
        else:
            self.call_soon(lambda: self._abort(request_id, reason))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread before the next step (PD workers: reserve pages, add prebuilt
        requests).

        Exceptions from ``fn`` are logged, never raised. Raises LoopStopped when the loop is not running.
        """
        self._put(fn)

    def wake(self) -> None:
        """Make the loop tick now instead of finishing its idle wait (e.g. new work for a tick hook)."""
        self._commands.put(None)

    # ---- loop thread only ----------------------------------------------------------------------------------
    def track(self, request_id: RequestId, on_event: OnEvent) -> None:
        """Route the engine's outputs for a request added outside ``submit`` (e.g. ``add_prebuilt_request``).

        Loop thread only (a tick hook or a ``call_soon`` function).
        """
        self._callbacks[request_id] = on_event

    def stats(self) -> LoopStats:
        """Counters of this loop; loop thread only for a consistent view."""
        return LoopStats(len(self._callbacks), self._commands.qsize(), self._steps_total,
                         self._step_seconds_total)

    def _put(self, command: _Command) -> None:
        with self._accept_lock:
            if not self._accepting:
                raise LoopStopped(f"{self._name} is not running")
            self._commands.put(command)

    def _run(self) -> None:
        if self._nice is not None:
            set_thread_nice(self._nice, self._name)
        try:
            while not self._stop.is_set():
                self._tick()
        except BaseException:
            logger.exception("%s crashed; failing every request in flight", self._name)
        finally:
            self._shutdown()

    def _tick(self) -> None:
        if self.engine.has_unfinished():
            wait_s = 0.0
        else:
            wait_s = self._busy_wait_s if self._hooks_busy else self._idle_wait_s
        self._drain(wait_s)
        if self.engine.has_unfinished() and not self._stop.is_set():
            self._step()
        busy = False
        for hook in self._hooks:
            try:
                busy = hook.on_tick() or busy
            except Exception:
                logger.exception("%s: tick hook %r failed", self._name, hook)
        self._hooks_busy = busy

    def _drain(self, wait_s: float) -> None:
        """Run queued commands; block up to ``wait_s`` for the first one."""
        try:
            command = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, command: _Command) -> None:
        if command is None:
            return
        if isinstance(command, _Submit):
            self._add(command)
            return
        try:
            command()
        except Exception:
            logger.exception("%s: queued call %r failed", self._name, command)

    def _unqueue(self, request_id: RequestId) -> str | None:
        """The submit of ``request_id`` left the queue: forget one count; the abort that waited for it, if
        any."""
        with self._submits_lock:
            left = self._queued_submits.get(request_id, 0) - 1
            if left > 0:
                self._queued_submits[request_id] = left
            else:
                self._queued_submits.pop(request_id, None)
            return self._abort_on_add.pop(request_id, None) if left <= 0 else None

    def _add(self, s: _Submit) -> None:
        aborted = self._unqueue(s.request_id)
        if aborted is not None:
            logger.info("%s: request %s aborted before it started: %s", self._name, s.request_id, aborted)
            self._deliver(s.on_event, RequestFailed(s.request_id, RequestAborted(s.request_id, aborted)))
            return
        if s.request_id in self._callbacks:
            self._deliver(s.on_event,
                          RequestFailed(s.request_id, RequestRejected(s.request_id, "duplicate id")))
            return
        # only what is set: an engine without migration or DP attention need not take those arguments
        extra: dict[str, Any] = {}
        if s.resumed_output_ids:
            extra["resumed_output_ids"] = s.resumed_output_ids
        if s.dp_rank is not None:
            extra["dp_rank"] = s.dp_rank
        try:
            self.engine.add_request(s.request_id, s.prompt_token_ids, s.params, **extra)
        except Exception as e:  # an engine error concerns this request only
            if not isinstance(e, EngineError):
                logger.exception("%s: add_request(%s) failed unexpectedly", self._name, s.request_id)
            self._deliver(s.on_event, RequestFailed(s.request_id, e))
            return
        self._callbacks[s.request_id] = s.on_event

    def _abort(self, request_id: RequestId, reason: str) -> None:
        on_event = self._callbacks.pop(request_id, None)
        if on_event is None:
            with self._submits_lock:
                if request_id in self._queued_submits:   # its submit is still queued: abort it there
                    self._abort_on_add[request_id] = reason
            return
        self.engine.abort_request(request_id)
        logger.info("%s: request %s aborted: %s", self._name, request_id, reason)
        self._deliver(on_event, RequestFailed(request_id, RequestAborted(request_id, reason)))

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("%s: engine step failed; failing every request in flight (%d)",
                             self._name, len(self._callbacks))
            self._fail_all(e)
            if isinstance(e, TensorParallelError) and self._on_fatal is not None and not self._fatal_reported:
                self._fatal_reported = True
                self._on_fatal(e)
            return
        finally:
            self._steps_total += 1
            self._step_seconds_total += time.perf_counter() - start
        for output in outputs:
            self._dispatch(output)

    def _dispatch(self, output: RequestOutput) -> None:
        if output.finished:
            on_event = self._callbacks.pop(output.request_id, None)
        else:
            on_event = self._callbacks.get(output.request_id)
        if on_event is None:
            logger.debug("%s: output for untracked request %s dropped", self._name, output.request_id)
            return
        if not self._deliver(on_event, output) and not output.finished:
            self._abort(output.request_id, "its output callback failed")

    def _deliver(self, on_event: OnEvent, event: LoopEvent) -> bool:
        try:
            on_event(event)
            return True
        except Exception:
            logger.exception("%s: callback of request %s failed", self._name, event.request_id)
            return False

    def _fail_all(self, error: Exception) -> None:
        callbacks, self._callbacks = self._callbacks, {}
        for request_id, on_event in callbacks.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("%s: abort_request(%s) failed", self._name, request_id)
            self._deliver(on_event, RequestFailed(request_id, error))

    def _shutdown(self) -> None:
        with self._accept_lock:
            self._accepting = False
        stopped = LoopStopped(f"{self._name} stopped")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                self._unqueue(command.request_id)
                self._deliver(command.on_event, RequestFailed(command.request_id, stopped))
        self._fail_all(stopped)
        logger.info("%s stopped", self._name)


def set_thread_nice(nice: int, name: str) -> bool:
    """Set the calling thread's nice value to ``nice`` (Linux: ``setpriority(PRIO_PROCESS, tid)`` changes that
    thread alone; the threads it starts later inherit it). Called by the thread itself (``EngineLoop``'s).

    Returns True when the thread now runs at ``nice``. False, with one warning naming ``name``, when the
    kernel refused it: a nice below the process's own needs ``CAP_SYS_NICE`` (or ``RLIMIT_NICE``), and without
    it the thread keeps its priority and runs as before.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        logger.warning("%s keeps nice %d: setting %d was refused (%s; a nice below the process's needs "
                       "CAP_SYS_NICE)", name, os.getpriority(os.PRIO_PROCESS, tid), nice, e.strerror)
        return False
    logger.info("%s runs at nice %d", name, nice)
    return True
