"""The instances a router can pair: the members of the fleet (``serving.router.discovery``: this server's PD
models, or a membership registry; optionally a static list), with their load, freshness and a circuit breaker
each.

Threads: ``FleetWatcher`` owns the thread ``router-fleet-<router>``, which every ``fleet_refresh_s`` reads the
members and asks each member's own rendezvous for its status (``GET /v1/instances``: load, epoch); it swaps in
an immutable ``FleetSnapshot`` (one reference assignment). A member whose rendezvous refuses the connection
(its process is gone) leaves the snapshot at once; one that does not answer keeps its last status until it is
stale (``instance_stale_s``; a router gives its open streams up only after ``blip_tolerance_s``). Everything
else (``Fleet.candidates``, breakers, the router's own pending assignments) runs on the router's event loop
thread only, so it takes no lock.

Load between two reports: an instance reports its load with every heartbeat (``InstanceLoad``), so a burst of
requests routed within one heartbeat would all see the same numbers. The router therefore adds what it itself
assigned to an instance after that instance's last report (``note_assigned``) and drops those notes once a
newer report covers them — the same correction SGLang's router makes with its local request counts. The other
way round too: a request that ended after the instance's last report (``note_finished``) may still be counted
in it (its prompt as queued, its pages as used), so the router takes it out of that report until a newer one
comes. A conversation's next turn, sent the moment the last one ended, would otherwise find its own previous
turn still queued on the prefill holding its prefix, and go to the other one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError, RendezvousRefused
from bootstrap.messages import InstanceLoad, InstanceStatus
from serving.router.config import RouterConfig, TargetSpec
from serving.router.discovery import FleetMember, MemberSource

logger = logging.getLogger(__name__)

InstanceId = str
#: How long the router remembers that an instance was draining after it last saw it so (a draining member
#: leaves the member list while its streams run on), seconds: longer than any drain.
DRAINING_MEMORY_S = 600.0


@dataclass(frozen=True)
class Target:
    """Where one prefill or decode instance is served: ``model_name`` on the tritonserver at ``endpoint``
    (``host:port`` of its gRPC service). ``instance_id`` is fleet-unique (two servers may both serve a model
    named ``prefill``); ``epoch`` changes when the instance restarts."""

    instance_id: InstanceId
    role: str
    endpoint: str
    model_name: str
    epoch: int = 0
    rendezvous_url: str = ""   # the instance's own rendezvous: a decode child is told its prefill's
    # True: ``endpoint`` is the worker's own endpoint (``serving.workers.endpoint``, child frames), which it
    # has when the router uses them (``RouterConfig.worker_endpoints``); False: the tritonserver (gRPC) that
    # serves ``model_name``
    worker_endpoint: bool = False
    # the DP-attention rank of the instance that is to run the request (``serving.router.ranks``); None: the
    # instance itself, which places the request (one without DP attention, or a target not paired yet)
    dp_rank: int | None = None


@dataclass(frozen=True)
class RankLoad:
    """One DP-attention rank of a candidate as the router sees it now: the rank's reported free pages and
    queued prompt tokens (``InstanceLoad.rank_free_pages``, ``rank_queued_prompt_tokens``) with the router's
    own assignments to that rank since the report."""

    free_pages: int
    queued_prompt_tokens: int


@dataclass(frozen=True)
class Candidate:
    """A healthy instance and its load as the router sees it now (reported load + the router's own
    assignments since that report). ``largest_free_pages``: the most pages one request can take (a
    DP-attention instance: its freest rank's, ``InstanceLoad.rank_free_pages``); None: ``free_pages``.
    ``ranks``: a DP-attention instance's ranks, rank 0 first; empty for an instance of one pool."""

    target: Target
    queued_requests: int
    queued_prompt_tokens: int
    free_pages: int
    total_pages: int
    page_size: int
    largest_free_pages: int | None = None
    ranks: tuple[RankLoad, ...] = ()

    def pages_for(self, num_tokens: int) -> int:
        """Pages ``num_tokens`` tokens take in this instance's pool (``page_size`` 0: unknown → 0)."""
        return -(-num_tokens // self.page_size) if self.page_size > 0 else 0

    def fits(self, num_pages: int) -> bool:
        """Whether one request of ``num_pages`` pages fits now (in one rank's pool for a DP instance)."""
        largest = self.free_pages if self.largest_free_pages is None else self.largest_free_pages
        return largest >= num_pages


@dataclass(frozen=True)
class FleetSnapshot:
    """The members' last statuses; ``taken_s`` is ``time.monotonic()`` of the reading, and each status's
    ``age_s`` counts from its instance's last answer (so a member that stopped answering ages out).
    ``draining``: (instance id, epoch) of every instance seen draining lately (``DRAINING_MEMORY_S``), also
    after it left the member list: its streams still run there."""

    instances: tuple[InstanceStatus, ...] = ()
    taken_s: float = 0.0
    draining: frozenset[tuple[InstanceId, int]] = frozenset()


@dataclass
class CircuitBreaker:
    """Consecutive failures open the breaker for ``cooldown_s``; then one trial request is let through
    (half-open): its success closes the breaker, its failure opens it again."""

    threshold: int
    cooldown_s: float
    failures: int = 0
    open_until_s: float = 0.0
    trial_in_flight: bool = False

    def available(self, now_s: float) -> bool:
        if self.failures < self.threshold:
            return True
        return now_s >= self.open_until_s and not self.trial_in_flight

    def on_pick(self) -> None:
        if self.failures >= self.threshold:
            self.trial_in_flight = True

    def record(self, ok: bool, now_s: float) -> bool:
        """Count one outcome; returns True when it changed whether the instance is in rotation."""
        was_open = self.failures >= self.threshold
        self.trial_in_flight = False
        if ok:
            self.failures = 0
            return was_open
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until_s = now_s + self.cooldown_s
        return not was_open and self.failures >= self.threshold


@dataclass
class _Pending:
    assigned_s: float
    prompt_tokens: int
    tokens_to_reserve: int
    dp_rank: int | None = None   # the rank the router chose (None: the instance places it)


@dataclass
class _Ended:
    ended_s: float
    prompt_tokens: int
    tokens_to_reserve: int
    dp_rank: int | None = None


@dataclass
class _InstanceState:
    breaker: CircuitBreaker
    epoch: int
    pending: list[_Pending] = field(default_factory=list)   # assigned after the last report
    ended: list[_Ended] = field(default_factory=list)       # assigned before the last report, ended after it


class Fleet:
    """The router's view of the fleet; event loop thread only (``update`` may come from any thread)."""

    def __init__(self, config: RouterConfig, now: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._now = now
        self._snapshot = FleetSnapshot()
        self._states: dict[InstanceId, _InstanceState] = {}
        self._static = {role: config.static_targets(f"{role}_models") for role in ("prefill", "decode")}

    def update(self, snapshot: FleetSnapshot) -> None:
        """Swap in a newer reading of the fleet (any thread: one reference assignment)."""
        self._snapshot = snapshot

    def candidates(self, role: str, exclude: frozenset[InstanceId] = frozenset()) -> list[Candidate]:
        """Healthy instances of ``role`` (``"prefill"``/``"decode"``): registered, heard from within
        ``instance_stale_s``, breaker closed (or due a trial), in the static list when there is one, not in
        ``exclude``; ordered by instance id.

        Panic mode (Envoy's term): when every fresh instance of the role has its breaker open, they are all
        returned anyway: heartbeating instances that failed recently beat a fleet that refuses every request.
        """
        now_s = self._now()
        fresh, available = [], []
        for status, state, reported_s in self._fresh(role, exclude):
            candidate = self._candidate(status, state, reported_s)
            fresh.append(candidate)
            if state.breaker.available(now_s):
                available.append(candidate)
        return available or fresh

    def _fresh(self, role: str, exclude: frozenset[InstanceId] = frozenset()
               ) -> list[tuple[InstanceStatus, _InstanceState, float]]:
        """Registered, allowed instances of ``role`` heard from within ``instance_stale_s`` and not draining,
        with their state and the local time of their last report."""
        now_s = self._now()
        out = []
        for status in self._snapshot.instances:
            if (status.role != role or status.instance_id in exclude or status.draining
                    or not self._allowed(status)):
                continue
            reported_s = self._snapshot.taken_s - status.age_s
            if now_s - reported_s <= self._config.instance_stale_s:
                out.append((status, self._state(status), reported_s))
        return out

    def responsive(self, instance_id: InstanceId) -> bool:
        """Whether ``instance_id`` is registered and answered its rendezvous within ``instance_stale_s`` (its
        breaker aside): False for a server that died, froze, or that this router can no longer reach."""
        now_s = self._now()
        return any(status.instance_id == instance_id
                   and now_s - (self._snapshot.taken_s - status.age_s) <= self._config.instance_stale_s
                   for status in self._snapshot.instances)

    def gone(self, target: Target) -> bool:
        """Whether ``target``'s instance is known dead: no longer in the fleet's reading (its rendezvous
        refused a connection, so its process ended; or the registry dropped it) and not draining. An instance
        that only stopped answering (a link down, a stalled host) stays in the reading with its last status:
        not gone."""
        return not any(s.instance_id == target.instance_id for s in self._snapshot.instances) \
            and not self.draining(target)

    def draining(self, target: Target) -> bool:
        """Whether ``target`` (this epoch of the instance) is draining: its server stops or its model unloads;
        it ends the streams it has, and the router pairs it no more."""
        key = (target.instance_id, target.epoch)
        return key in self._snapshot.draining or any(
            s.draining and (s.instance_id, s.epoch) == key for s in self._snapshot.instances)

    def epochs(self) -> dict[InstanceId, int]:
        """Instance id → the epoch of its registration in the current reading (a restarted or reloaded
        instance shows a new one)."""
        return {status.instance_id: status.epoch for status in self._snapshot.instances}

    def note_assigned(self, target: Target, prompt_tokens: int, tokens_to_reserve: int) -> None:
        """The router sent a request to ``target`` (on ``target.dp_rank``): count it until the instance's next
        report covers it."""
        state = self._states.get(target.instance_id)
        if state is not None:
            state.pending.append(_Pending(self._now(), prompt_tokens, tokens_to_reserve, target.dp_rank))
            state.breaker.on_pick()

    def note_finished(self, target: Target, prompt_tokens: int, tokens_to_reserve: int) -> None:
        """A request ``note_assigned`` counted on ``target`` ended there (its attempt is over: prefill's queue
        no longer holds it, decode freed or is freeing its pages): stop counting it now instead of at the next
        report, which a short request can beat (a conversation's next turn, sent the moment the last one
        ended, found its own previous turn still counted as queued on the prefill holding its prefix, and went
        to the other one). Removes one not yet reported assignment of the same sizes; when a report already
        covered it, that report (and any other taken before now) counts it no longer: its prompt tokens leave
        the queued ones and its reserved pages come back, floored at nothing queued and capped at the pool,
        until a newer report. A report taken after the request left the instance's queue but before the router
        heard it end is then corrected twice; the floor bounds that, and the next report (every heartbeat)
        replaces it."""
        state = self._states.get(target.instance_id)
        if state is None or state.epoch != target.epoch:
            return
        reported_s = self._reported_s(target)
        if reported_s is not None:
            state.pending = [p for p in state.pending if p.assigned_s >= reported_s]
        for i, pending in enumerate(state.pending):
            if (pending.prompt_tokens, pending.tokens_to_reserve, pending.dp_rank) == \
                    (prompt_tokens, tokens_to_reserve, target.dp_rank):
                del state.pending[i]
                return
        state.ended.append(_Ended(self._now(), prompt_tokens, tokens_to_reserve, target.dp_rank))

    def _reported_s(self, target: Target) -> float | None:
        """Local time of ``target``'s last report in the current reading; None when it is not in it."""
        for status in self._snapshot.instances:
            if status.instance_id == target.instance_id and status.epoch == target.epoch:
                return self._snapshot.taken_s - status.age_s
        return None

    def record(self, target: Target, ok: bool) -> None:
        """Outcome of one request on ``target`` for its breaker (client cancels are not outcomes)."""
        state = self._states.get(target.instance_id)
        if state is not None and state.epoch == target.epoch:
            if state.breaker.record(ok, self._now()):
                logger.warning("instance %s %s rotation (%d consecutive failures)", target.instance_id,
                               "back in" if ok else "taken out of", state.breaker.failures)

    def health(self) -> dict[str, dict[InstanceId, bool]]:
        """Role → instance id → in rotation now, for every registered instance (metrics, readiness)."""
        now_s = self._now()
        out: dict[str, dict[InstanceId, bool]] = {"prefill": {}, "decode": {}}
        for role, instances in out.items():
            healthy = {status.instance_id for status, state, _ in self._fresh(role)
                       if state.breaker.available(now_s)}
            for status in self._snapshot.instances:
                if status.role == role and self._allowed(status):
                    instances[status.instance_id] = status.instance_id in healthy
        return out

    def ready(self) -> bool:
        """True when at least one prefill and one decode instance are fresh (registered and heartbeating)."""
        return bool(self._fresh("prefill")) and bool(self._fresh("decode"))

    def _allowed(self, status: InstanceStatus) -> bool:
        specs: Sequence[TargetSpec] = self._static.get(status.role, ())
        return not specs or any(s.model_name == status.model_name and s.endpoint == status.address
                                for s in specs)

    def _state(self, status: InstanceStatus) -> _InstanceState:
        state = self._states.get(status.instance_id)
        if state is None or state.epoch != status.epoch:   # new, or restarted: a fresh breaker
            state = _InstanceState(CircuitBreaker(self._config.breaker_failures,
                                                  self._config.breaker_cooldown_s), status.epoch)
            self._states[status.instance_id] = state
        return state

    def _candidate(self, status: InstanceStatus, state: _InstanceState, reported_s: float) -> Candidate:
        state.pending = [p for p in state.pending if p.assigned_s >= reported_s]
        state.ended = [e for e in state.ended if e.ended_s > reported_s]
        load: InstanceLoad = status.load

        def pages(tokens: int) -> int:
            return -(-tokens // load.page_size) if load.page_size else 0

        pending_pages = sum(pages(p.tokens_to_reserve) for p in state.pending)
        ended_pages = sum(pages(e.tokens_to_reserve) for e in state.ended)
        reported_tokens = max(0, load.num_queued_prompt_tokens - sum(e.prompt_tokens for e in state.ended))
        reported_free = min(load.num_total_pages, load.num_free_pages + ended_pages) if load.num_total_pages \
            else load.num_free_pages
        direct = bool(self._config.worker_endpoints and status.worker_endpoint)
        target = Target(status.instance_id, status.role, status.worker_endpoint if direct else status.address,
                        status.model_name, status.epoch, status.rendezvous_url, worker_endpoint=direct)
        free = reported_free - pending_pages
        # a DP instance: a request's pages lie in one rank's pool
        ranks = _rank_loads(load, state.pending, state.ended, pages)
        largest = min(free, max(r.free_pages for r in ranks)) if ranks else None
        return Candidate(target, load.num_queued_requests + len(state.pending),
                         reported_tokens + sum(p.prompt_tokens for p in state.pending),
                         free, load.num_total_pages, load.page_size, largest, ranks)


def _rank_loads(load: InstanceLoad, pending: list[_Pending], ended: list[_Ended],
                pages: Callable[[int], int]) -> tuple[RankLoad, ...]:
    """Each DP rank's reported load (``rank_free_pages``, ``rank_queued_prompt_tokens``) corrected as the
    instance's is (``Fleet._candidate``), by rank: an assignment since the report takes its pages from its
    rank and adds its prompt there (one without a rank, which the instance placed, may have gone to any rank:
    its pages are taken from each); a request that ended since gives its rank's back (capped at the rank's
    share of the pool, floored at nothing queued). () for an instance of one pool."""
    n = len(load.rank_free_pages)
    if n == 0:
        return ()
    queued = list(load.rank_queued_prompt_tokens[:n]) + [0] * max(0, n - len(load.rank_queued_prompt_tokens))
    free = list(load.rank_free_pages)
    rank_total = load.num_total_pages // n if load.num_total_pages else 0
    for e in ended:
        if e.dp_rank is not None and 0 <= e.dp_rank < n:
            queued[e.dp_rank] = max(0, queued[e.dp_rank] - e.prompt_tokens)
            free[e.dp_rank] += pages(e.tokens_to_reserve)
            if rank_total:
                free[e.dp_rank] = min(rank_total, free[e.dp_rank])
    for p in pending:
        if p.dp_rank is not None and 0 <= p.dp_rank < n:
            queued[p.dp_rank] += p.prompt_tokens
            free[p.dp_rank] -= pages(p.tokens_to_reserve)
        else:
            free = [f - pages(p.tokens_to_reserve) for f in free]
    return tuple(RankLoad(f, q) for f, q in zip(free, queued, strict=True))


class FleetWatcher:
    """Keeps a ``Fleet`` fresh from a ``MemberSource`` and the members' own rendezvous, on its own thread.

    The constructor starts nothing; ``start`` reads the fleet once and starts the thread; ``stop`` ends it
    (within ``timeout_s``).
    """

    def __init__(self, fleet: Fleet, config: RouterConfig, source: MemberSource, name: str,
                 on_refresh: Callable[[], None] = lambda: None, poll_timeout_s: float = 0.5) -> None:
        """
        Args:
            fleet: updated after every reading.
            config: ``fleet_refresh_s``, the fleet secret.
            source: who the members are.
            name: the router's name (the thread's).
            on_refresh: called on the watcher thread after each reading (e.g. to wake the metrics).
            poll_timeout_s: how long one member's rendezvous may take to answer.
        """
        self._fleet = fleet
        self._config = config
        self._source = source
        self._name = name
        self._on_refresh = on_refresh
        self._poll_timeout_s = poll_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(4, thread_name_prefix=f"router-poll-{name}")
        # rendezvous URL → client (one poll per URL at a time)
        self._clients: dict[str, BootstrapClient] = {}
        self._last: dict[InstanceId, tuple[InstanceStatus, float]] = {}   # last status and when it was heard
        self._draining: dict[tuple[InstanceId, int], float] = {}   # (id, epoch) seen draining → when, last

    def start(self) -> None:
        """Read the fleet once (a failure is retried by the thread) and start the thread."""
        if self._thread is not None:
            raise RuntimeError("FleetWatcher already started")
        self.refresh()
        self._thread = threading.Thread(target=self._run, name=f"router-fleet-{self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._source.close()
        for client in self._clients.values():
            client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._config.fleet_refresh_s):
            try:
                self.refresh()
            except Exception:   # the watcher must outlive any one bad reading
                logger.exception("fleet refresh failed")

    def refresh(self) -> None:
        """One reading: the members, then every member's status from its own rendezvous (in parallel)."""
        members, _fresh = self._source.members()
        now_s = time.monotonic()
        results = list(self._pool.map(self._poll, members))
        current: dict[InstanceId, tuple[InstanceStatus, float]] = {}
        for member, status in zip(members, results, strict=True):
            if status is None:   # refused: the process is gone; learn the member anew
                self._source.forget(member.instance_id)
            elif isinstance(status, InstanceStatus):
                current[member.instance_id] = (status, now_s)
                if status.draining:   # being unloaded: kept (its streams run on) but never paired; a reload's
                    # successor has its model's name: learn the member anew, which asks that model again
                    self._draining[(status.instance_id, status.epoch)] = now_s
                    self._source.forget(member.instance_id)
            elif member.instance_id in self._last:   # no answer: keep the last status until it is stale
                current[member.instance_id] = self._last[member.instance_id]
        self._last = current
        self._draining = {key: seen_s for key, seen_s in self._draining.items()
                          if now_s - seen_s <= DRAINING_MEMORY_S}
        statuses = tuple(replace(status, age_s=status.age_s + (now_s - heard_s))
                         for status, heard_s in current.values())
        self._fleet.update(FleetSnapshot(statuses, now_s, frozenset(self._draining)))
        try:
            self._on_refresh()
        except Exception:
            logger.exception("fleet refresh hook failed")

    def _poll(self, member: FleetMember) -> InstanceStatus | None | BootstrapError:
        """The member's status (None: refused; the error: no answer) as its rendezvous reports it, with the
        member's address as the router reaches it."""
        client = self._clients.get(member.rendezvous_url)
        try:
            if client is None:   # an http:// URL in a TLS fleet is refused here (TLSError): no answer
                client = self._clients.setdefault(member.rendezvous_url, BootstrapClient(
                    member.rendezvous_url, self._poll_timeout_s, self._config.fleet_secret,
                    self._config.fleet_tls))
            statuses = client.list_instances()
        except RendezvousRefused:
            logger.warning("fleet member %s is gone (its rendezvous %s refused)", member.instance_id,
                           member.rendezvous_url)
            return None
        except BootstrapError as e:
            return e
        for status in statuses:
            if status.instance_id == member.instance_id:
                return replace(status, address=member.address, model_name=member.model_name,
                               rendezvous_url=member.rendezvous_url)
        return None   # another instance lives there now (a restart on the same port): describe it again
