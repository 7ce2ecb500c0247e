"""``PDOrchestrator``: the life of one client request in the router (``pd_ensemble``).

1. **admission** (``Admission``): wait for one of ``max_inflight_requests`` slots in a bounded queue, or end
   at once with "server busy";
2. **pair**: count the prompt's tokens, take the healthy candidates of the fleet and let the policy choose a
   (prefill, decode) pair — or decode alone for a short prompt (direct decode);
3. **room**: a random 63-bit bootstrap room, unique among this router's rooms in flight;
4. **children**: both child requests at once through the ``Launcher`` (each stream read by its own task into
   one queue); the router's assignment is noted in the fleet so the next pick sees it;
5. **merge**: prefill's first token first, then decode's tokens in order (decode responses that arrive earlier
   are held back);
6. **end** with exactly one final chunk: success; a client cancel; a failure. On a cancel or a failure both
   child streams are cancelled: Triton tells both children, which drop the room (telling each other over the
   KV transport) and free its pages. A failure **before the first token** reached the client is retried once
   on another pair (the instance that failed is excluded, and its partner in that pair while the fleet has
   another pair; an instance the router could not reach but whose rendezvous still answers stays a last
   resort, once: the connection was stale); after the first token the request **migrates** (``migration.py``):
   the open children are cancelled and a direct decode on another decode instance resumes it from the tokens
   already sent, into the same client stream, up to ``migration_limit`` times, then the error ends it. A
   request whose decode **drains** (its server stops) moves the same way, when another decode is in rotation,
   instead of holding up that stop. An error
   about the request itself (bad input, rejected by the engine) is never retried nor migrated. Successes,
   unreachable children and silent (idle-timed-out) children feed the instances' circuit breakers; cancels and
   errors a child reports do not.

Event loop thread only: ``generate`` is a coroutine; one runs per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from engine.outputs import TokenLogprob
from serving.delta import Delta, ErrorKind
from serving.parsing.request import GenerateRequest, RawValue, sample_sampling
from serving.router.admission import Admission, ServerBusy
from serving.router.children import ChildStreams
from serving.router.config import RouterConfig
from serving.router.fleet import Fleet, Target
from serving.router.launch import FORWARDED_INPUTS, ChildCall, Launcher
from serving.router.migration import MigrationState, pick_decode
from serving.router.pairing import Demand, NoInstance, Pair, PairingPolicy
from serving.schema import OUTPUTS, Carry

logger = logging.getLogger(__name__)

Room = int
ROOM_BITS = 63

#: How often the merge loop wakes up to check for client cancellation and the idle deadline, in seconds.
CANCEL_POLL_INTERVAL_S = 0.02
class RouterMetrics(Protocol):
    """What the orchestrator reports (``serving.router.metrics``)."""

    def selected(self, role: str, instance_id: str, dp_rank: int | None = None) -> None:
        """A request was sent to ``instance_id`` as ``role``, on its DP-attention rank ``dp_rank`` if any."""
        ...

    def retried(self) -> None: ...

    def migrated(self) -> None: ...

    def rejected(self, reason: str) -> None: ...

    def request_done(self, outcome: str) -> None: ...


@dataclass(frozen=True)
class RoutedRequest:
    """One client request as the router handles it: the parsed request and the raw inputs to forward."""

    request: GenerateRequest
    inputs: Mapping[str, RawValue]

    @property
    def forwarded(self) -> dict[str, RawValue]:
        """The children's LLM inputs: the client's prompt and chat-template flag as sent, and the sampling
        parameters as parsed (from the ``sampling_parameters`` input or the request's Triton parameters)."""
        values = {name: self.inputs[name] for name in FORWARDED_INPUTS
                  if name in self.inputs and name != "sampling_parameters"}
        if self.request.sampling:
            values["sampling_parameters"] = json.dumps(self.request.sampling)
        return values

    def for_sample(self, index: int) -> RoutedRequest:
        """Sample ``index`` of an ``n``-sample request: ``n == 1``, seed ``seed + index``."""
        request = self.request
        sample = replace(request, params=request.params.for_sample(index),
                         sampling=sample_sampling(request.sampling, request.params, index))
        return RoutedRequest(sample, self.inputs)


class RoomAllocator:
    """Unique 63-bit bootstrap rooms (random, so that several routers never collide in practice)."""

    def __init__(self) -> None:
        self._in_flight: set[Room] = set()

    def allocate(self) -> Room:
        while True:
            room = secrets.randbits(ROOM_BITS)
            if room not in self._in_flight:
                self._in_flight.add(room)
                return room

    def release(self, room: Room) -> None:
        self._in_flight.discard(room)

    def __len__(self) -> int:
        return len(self._in_flight)


#: Delta attributes the merge carries over a request's children (``serving.schema.Carry``): the largest any
#: child reported; the largest the child that prefilled reported
_MAX = tuple(o.child.attribute for o in OUTPUTS if o.child is not None and o.carry is Carry.MAX)
_PREFILLED = tuple(o.child.attribute for o in OUTPUTS if o.child is not None and o.carry is Carry.PREFILLED)


@dataclass
class _MergeState:
    first_done: bool = False
    emitted: bool = False   # a chunk with text went to the client: no retry after this
    prefill_final: bool = False
    decode_final: bool = False
    decode_has_kv: bool = False   # decode sent tokens of its own or its FINAL: it holds the prompt's KV
    held: list[Delta] = field(default_factory=list)
    # the outputs carried from response to response (``serving.schema.Carry`` MAX, PREFILLED), by attribute
    carried: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(_MAX + _PREFILLED, 0))
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    # the child that prefills the prompt (prefill; decode when direct): the PREFILLED outputs are its
    prefilled_by: str = "prefill"
    # what came with the finish reason: sent with the final chunk, so that the last response carries the last
    # tokens (the vLLM convention: no response without tokens)
    tail_text: str = ""
    tail_logprobs: list[TokenLogprob] | None = None
    migration: MigrationState = field(default_factory=MigrationState)
    rooms: list[Room] = field(default_factory=list)   # the rooms of migrated children, released at the end
    drain_check_s: float = 0.0   # monotonic: when a draining decode's stream may next be checked for a move

    def final_chunk(self, finish_reason: str | None) -> Delta:
        return Delta(text=self.tail_text, finish_reason=finish_reason,
                     num_output_tokens=self.num_output_tokens, cumulative_logprob=self.cumulative_logprob,
                     num_migrations=self.migration.num_migrations,
                     logprobs=tuple(self.tail_logprobs) if self.tail_logprobs is not None else None,
                     final=True, **self.carried)


class _ChildInputs(NamedTuple):
    """What a migration needs to start a child: the forwarded inputs and the request's demand."""

    forwarded: dict[str, RawValue]
    demand: Demand


@dataclass(frozen=True)
class _Outcome:
    """How one attempt ended: ``final`` for the client, or a failure on ``culprit`` to retry (nothing reached
    the client) or, with ``migrate``, to migrate (the first token did)."""

    final: Delta | None = None
    error: str = ""
    culprit: Target | None = None
    migrate: bool = False
    unreachable: bool = False   # the culprit could not be reached, or its stream broke


class PDOrchestrator:
    def __init__(self, config: RouterConfig, fleet: Fleet, policy: PairingPolicy, launcher: Launcher,
                 count_tokens: Callable[[GenerateRequest], list[int] | int],
                 metrics: RouterMetrics | None = None, tokenizer_id: str = "") -> None:
        """
        Args:
            config: admission bounds, retries, idle timeout.
            fleet: healthy candidates and their breakers.
            policy: picks the pair of each attempt.
            launcher: sends child requests (closing a stream cancels that child).
            count_tokens: the prompt's token ids (after the chat template) of a request, or only their count
                (an estimate): the ids let a cache-aware policy match prefixes.
            metrics: selections, retries, rejections, outcomes; None disables.
            tokenizer_id: the fingerprint of the tokenizer ``count_tokens`` uses (``Tokenizer.fingerprint``);
                non-empty: the prompt's ids go to the children with it, which skip tokenizing when it is their
                own tokenizer's (tokenized once per request).
        """
        self._config = config
        self._fleet = fleet
        self._policy = policy
        self._launcher = launcher
        self._count_tokens = count_tokens
        self._metrics = metrics
        self._tokenizer_id = tokenizer_id
        self.admission = Admission(config.max_inflight_requests, config.max_queued_requests,
                                   config.queue_timeout_s)
        self.rooms = RoomAllocator()

    async def generate(self, routed: RoutedRequest, emit: Callable[[Delta], None],
                       is_cancelled: Callable[[], bool]) -> None:
        """Serve one request to its end; ``emit`` gets the client's chunks in order, the final one exactly
        once, last. Never raises (a failure becomes a final chunk with ``error``), except ``CancelledError``
        when the task itself is cancelled (shutdown): the caller then ends the stream."""
        try:
            async with self.admission.admit():
                final = await self._serve(routed, emit, is_cancelled)
        except ServerBusy as e:
            self._count_rejected("busy")
            final = Delta.failure(str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:   # a bug here must still end the client's stream
            logger.exception("orchestration failed")
            final = Delta.failure(f"internal error: {e}")
        if self._metrics is not None:
            self._metrics.request_done("cancelled" if final.finish_reason == "abort" else
                                       "failed" if final.error is not None else "finished")
        emit(final)

    async def _serve(self, routed: RoutedRequest, emit: Callable[[Delta], None],
                     is_cancelled: Callable[[], bool]) -> Delta:
        tokens = self._count_tokens(routed.request)
        max_tokens = routed.request.params.max_tokens
        demand = Demand(tokens, max_tokens) if isinstance(tokens, int) else \
            Demand(len(tokens), max_tokens, tuple(tokens))
        failed: dict[str, int] = {}     # instances that failed this request → their epoch then
        # their partners in the failed pairs: not taken again while others exist
        avoided: set[str] = set()
        last_resort: set[str] = set()   # failed at the router's connection, yet responsive: taken last, once
        last_error = ""
        for attempt in range(1 + self._config.max_retries):
            excluded = self._still_failed(failed)
            try:
                pair = self._choose_avoiding(demand, excluded, frozenset(avoided), frozenset(last_resort))
            except NoInstance as e:
                # none left: wait for one the fleet does not have yet (a reloaded or restarted instance comes
                # back with a new epoch; the same id then counts as new); if none comes, the failure itself is
                # the client's answer, not the missing second pair
                try:
                    waited = await self._wait_for_pair(demand, is_cancelled,
                                                       lambda: self._still_failed(failed))
                except NoInstance as still:
                    if last_error:
                        return Delta.failure(f"{last_error} (no other {e.role} instance to retry on)")
                    self._count_rejected(f"no_{still.role}")
                    return Delta.failure(str(still))
                if waited is None:   # the client went away while it waited
                    return Delta(finish_reason="abort", final=True)
                pair = waited
            room = self.rooms.allocate()
            try:
                outcome = await self._attempt(pair, room, routed, demand, emit, is_cancelled)
            finally:
                self.rooms.release(room)
            if outcome.final is not None:
                return outcome.final
            assert outcome.culprit is not None
            last_error = outcome.error
            culprit = outcome.culprit.instance_id
            if outcome.unreachable and culprit not in last_resort and self._fleet.responsive(culprit):
                # the router's connection failed, yet the instance answers its rendezvous: the connection was
                # stale (its server restarted on the same address, the path came back after a partition); the
                # launcher opened a new one, so the instance stays a fallback when no other is left
                last_resort.add(culprit)
            else:
                failed[culprit] = outcome.culprit.epoch
            # the partner may be the cause the culprit reported (a decode whose prefill died fails its room
            # first, and a retry on the same dead prefill would then use up the retry)
            avoided.update(t.instance_id for t in (pair.prefill, pair.decode)
                           if t is not None and t.instance_id != culprit)
            if attempt < self._config.max_retries:
                logger.warning("room=%d failed before its first token (%s); retrying on another pair", room,
                               outcome.error)
                if self._metrics is not None:
                    self._metrics.retried()
        return Delta.failure(last_error)

    def _still_failed(self, failed: dict[str, int]) -> frozenset[str]:
        """The instances that failed this request and are still the same incarnation (a restarted or reloaded
        instance, with a new epoch, did not fail it)."""
        epochs = self._fleet.epochs()
        return frozenset(i for i, epoch in failed.items() if epochs.get(i, epoch) == epoch)

    async def _wait_for_pair(self, demand: Demand, is_cancelled: Callable[[], bool],
                             excluded: Callable[[], frozenset[str]] = frozenset) -> Pair | None:
        """A pair for a request that found none (without the ``excluded()`` instances): the fleet is asked
        again every ``fleet_refresh_s`` for up to ``fleet_wait_s`` (a router that just loaded next to its
        workers has not read them yet when tritonserver says ready; a worker restarting or reloaded rejoins
        within seconds). Returns None when the client cancels meanwhile.

        Raises:
            NoInstance: still no pair after ``fleet_wait_s`` (at once when it is 0).
        """
        deadline_s = time.monotonic() + self._config.fleet_wait_s
        while True:
            try:
                return self._choose(demand, excluded())
            except NoInstance:
                if time.monotonic() >= deadline_s:
                    raise
            if is_cancelled():
                return None
            await asyncio.sleep(min(self._config.fleet_refresh_s, max(0.0, deadline_s - time.monotonic())))

    def _choose_avoiding(self, demand: Demand, excluded: frozenset[str], avoided: frozenset[str],
                         last_resort: frozenset[str]) -> Pair:
        """A pair without ``excluded`` instances; without ``avoided`` and ``last_resort`` ones too when the
        fleet has such a pair, else without ``last_resort`` ones when it has such a pair. Raises
        ``NoInstance`` as ``_choose``."""
        for without in (excluded | avoided | last_resort, excluded | last_resort):
            if without != excluded:
                try:
                    return self._choose(demand, without)
                except NoInstance:
                    pass
        return self._choose(demand, excluded)

    def _choose(self, demand: Demand, excluded: frozenset[str]) -> Pair:
        pair = self._policy.choose(self._fleet.candidates("prefill", excluded),
                                   self._fleet.candidates("decode", excluded), demand)
        for target in (pair.prefill, pair.decode):
            if target is not None:
                reserve = demand.tokens_to_reserve if target.role == "decode" else demand.prompt_tokens
                self._fleet.note_assigned(target, demand.prompt_tokens, reserve)
                if self._metrics is not None:
                    self._metrics.selected(target.role, target.instance_id, target.dp_rank)
        return pair

    async def _attempt(self, pair: Pair, room: Room, routed: RoutedRequest, demand: Demand,
                       emit: Callable[[Delta], None], is_cancelled: Callable[[], bool]) -> _Outcome:
        forwarded = routed.forwarded
        prefill = pair.prefill
        children = ChildStreams(self._launcher)
        targets = {"decode": pair.decode}
        if prefill is not None:
            targets["prefill"] = prefill
            children.start(ChildCall("prefill", prefill, room, "", "", forwarded, **self._prompt_ids(demand)))
        children.start(ChildCall("decode", pair.decode, room, prefill.instance_id if prefill else "",
                                 prefill.rendezvous_url if prefill else "", forwarded,
                                 **self._prompt_ids(demand)))
        direct = prefill is None
        state = _MergeState(first_done=direct, prefill_final=direct,
                            prefilled_by="decode" if direct else "prefill")
        assigned = dict(targets)   # what ``_choose`` counted on each instance
        try:
            return await self._merge(room, children, state, targets, _ChildInputs(forwarded, demand), emit,
                                     is_cancelled)
        finally:
            await children.cancel_all()   # ends (cancels) child streams still open
            for role, target in assigned.items():
                self._fleet.note_finished(target, demand.prompt_tokens,
                                          demand.tokens_to_reserve if role == "decode"
                                          else demand.prompt_tokens)
            for extra in state.rooms:
                self.rooms.release(extra)

    async def _merge(self, room: Room, children: ChildStreams, state: _MergeState, targets: dict[str, Target],
                     request: _ChildInputs, emit: Callable[[Delta], None],
                     is_cancelled: Callable[[], bool]) -> _Outcome:
        idle_timeout_s = self._config.request_idle_timeout_s
        last_event_s = time.monotonic()
        while not (state.prefill_final and state.decode_final):
            if is_cancelled():
                return _Outcome(final=state.final_chunk("abort"))
            draining = self._draining_decode(state, targets)
            if draining is not None:   # its server stops: move the stream instead of holding up the stop
                outcome = await self._migrate(room, children, state, targets, request, _Outcome(
                    error=f"decode {draining.instance_id} is draining", culprit=draining, migrate=True))
                if not outcome.migrate:
                    return outcome
                last_event_s = time.monotonic()
                continue
            event = await children.next_event(CANCEL_POLL_INTERVAL_S)
            if event is None:
                lost = self._lost_child(state, targets, time.monotonic() - last_event_s)
                if lost is not None:
                    role, response = lost
                    # a later call reconnects, not this connection
                    self._launcher.reset(targets[role].endpoint)
                    # a child whose instance stopped answering (a host cut off from the router, a frozen
                    # server) is treated as a broken stream: retried before the first token, else migrated
                    children.forget(role)
                    if self._ended_by_decode(room, role, response, state, targets):
                        continue
                    outcome = self._failed(room, role, response, state, targets)
                    if outcome.migrate:
                        outcome = await self._migrate(room, children, state, targets, request, outcome)
                    if not outcome.migrate:
                        return outcome
                    last_event_s = time.monotonic()
                    continue
                if time.monotonic() - last_event_s > idle_timeout_s:
                    reason = f"no response from prefill or decode for {idle_timeout_s:g} s"
                    logger.error("room=%d: %s (prefill_final=%s decode_final=%s)", room, reason,
                                 state.prefill_final, state.decode_final)
                    for target in targets.values():
                        self._fleet.record(target, ok=False)
                    if not (state.first_done and state.finish_reason is None
                            and self._config.migration_limit > 0):
                        return _Outcome(final=Delta.failure(reason), error=reason)
                    # a decode that hangs (a host cut off without a reset) is as gone as a dead one
                    outcome = await self._migrate(
                        room, children, state, targets, request,
                        _Outcome(error=reason, culprit=targets["decode"], migrate=True))
                    if not outcome.migrate:
                        return outcome
                    last_event_s = time.monotonic()
                continue
            call, response = event
            if not children.is_current(call):
                continue   # a child cancelled by a migration
            last_event_s = time.monotonic()
            if response.error is None:
                self._accept(call.role, response, state, emit)
                continue
            if self._ended_by_decode(room, call.role, response, state, targets):
                continue
            outcome = self._failed(room, call.role, response, state, targets)
            if outcome.migrate:
                outcome = await self._migrate(room, children, state, targets, request, outcome)
            if outcome.migrate:
                continue
            return outcome
        for target in targets.values():
            self._fleet.record(target, ok=True)
        return _Outcome(final=state.final_chunk(state.finish_reason))

    def _draining_decode(self, state: _MergeState, targets: dict[str, Target]) -> Target | None:
        """The request's decode when that instance drains (its server stops, its model unloads) and the
        request can move to another decode: past its first token, not finished, migration on and not used up,
        every token sent known by id, another decode in rotation. None otherwise: a request that cannot move
        runs to its end there (the drain waits for it, up to its timeout). Checked at most every
        ``fleet_refresh_s`` per request once its decode drains."""
        target = targets.get("decode")
        if target is None or state.decode_final or not state.first_done or state.finish_reason is not None \
                or not self._fleet.draining(target):
            return None
        now_s = time.monotonic()
        if now_s < state.drain_check_s:
            return None
        state.drain_check_s = now_s + self._config.fleet_refresh_s
        migration = state.migration
        if migration.num_migrations >= self._config.migration_limit or not migration.token_ids \
                or len(migration.token_ids) != state.num_output_tokens:
            return None
        others = self._fleet.candidates("decode", frozenset(migration.failed | {target.instance_id}))
        return target if others else None

    def _lost_child(self, state: _MergeState, targets: dict[str, Target],
                    silent_s: float) -> tuple[str, Delta] | None:
        """The role of the open child to give up on, with the error it gets, once the request has heard
        nothing for a while and that child's instance has not answered its rendezvous either
        (``Fleet.responsive``); None otherwise. How long depends on what the router knows of the instance
        (docs/healing.md, "Blips"):

        - known dead (``Fleet.gone``: its rendezvous refused the router, so its process ended): after
          ``instance_stale_s`` of silence (its stream usually broke at once anyway: a reset);
        - only silent (still listed with its last status: a link down, a stalled host): after
          ``blip_tolerance_s``; TCP's retransmissions bring the stream back after a link-down of up to ~10 s;
        - a prefill the request no longer needs (decode has the prompt's KV: ``_ended_by_decode``): after
          ``instance_stale_s``, gone or silent (giving it up loses nothing, and the client waits for no
          FINAL).

        A busy instance that still answers (a long prefill, decode waiting for KV) keeps its streams, and a
        stream that still delivers tokens is never dropped for a late load report. Without this such a stream
        would wait for the idle timeout (300 s by default)."""
        stale_s, blip_s = self._config.instance_stale_s, self._config.blip_tolerance_s
        if silent_s <= stale_s:
            return None
        for role, final in (("prefill", state.prefill_final), ("decode", state.decode_final)):
            target = targets.get(role)
            if final or target is None or self._fleet.responsive(target.instance_id):
                continue
            done_with = role == "prefill" and state.first_done and state.decode_has_kv
            if self._fleet.gone(target) or done_with:
                why = "its process is gone (its rendezvous refused the router)" if self._fleet.gone(target) \
                    else f"no answer from its rendezvous for over {stale_s:g} s"
                error = (f"{role} {target.instance_id} unreachable: {why}; its stream said nothing for "
                         f"{silent_s:.1f} s")
            elif silent_s > blip_s:
                error = (f"{role} {target.instance_id} unreachable: no response for {silent_s:.1f} s and no "
                         f"answer from its rendezvous either, past blip_tolerance_s ({blip_s:g} s)")
            else:
                continue   # silence only, for less than a blip lasts: wait for the link to come back
            return role, Delta.failure(error, ErrorKind.UNREACHABLE)
        return None

    def _ended_by_decode(self, room: Room, role: str, response: Delta, state: _MergeState,
                         targets: dict[str, Target]) -> bool:
        """True when ``role``'s failure (``response``) comes from the prefill after its first token arrived
        and decode sent tokens of its own or its FINAL: decode decodes only once the prompt's whole KV is in,
        so the request no longer needs the prefill, and the prefill's own end (its transfer's last
        acknowledgment, which a prefill host cut off from the router, a killed prefill or a lost message holds
        back) does not concern the client: the request goes on, or ends, with decode alone (no migration). The
        prefill then counts as ended; an unreachable one counts against its instance. The caller has given the
        stream up or it has ended."""
        if role != "prefill" or not (state.first_done and state.decode_has_kv) or "prefill" not in targets:
            return False   # without the first token (it comes from the prefill) the request is retried
        target = targets.pop("prefill")
        logger.warning("room=%d: prefill %s failed after decode had the prompt's KV (%s); decode goes on "
                       "alone", room, target.instance_id, response.error)
        if response.error_kind is ErrorKind.UNREACHABLE:
            self._fleet.record(target, ok=False)
        state.prefill_final = True
        return True

    def _failed(self, room: Room, role: str, response: Delta, state: _MergeState,
                targets: dict[str, Target]) -> _Outcome:
        culprit, error = targets[role], response.error or ""
        logger.info("room=%d: %s %s failed: %s", room, role, culprit.instance_id, error)
        if response.error_kind is ErrorKind.REQUEST:   # every instance would say the same: no retry
            return _Outcome(final=Delta.failure(error, ErrorKind.REQUEST), error=error)
        unreachable = response.error_kind is ErrorKind.UNREACHABLE
        if unreachable:
            # only an instance the router cannot reach counts against its breaker: errors a child reports
            # (a KV timeout under load, its peer failing) say little about the child itself
            self._fleet.record(culprit, ok=False)
        if state.first_done and state.finish_reason is None and self._config.migration_limit > 0:
            return _Outcome(error=error, culprit=culprit, migrate=True)   # the client has tokens: move on
        if state.emitted:
            return _Outcome(final=Delta.failure(error), error=error)
        # nothing reached the client yet: retry elsewhere
        return _Outcome(error=error, culprit=culprit, unreachable=unreachable)

    async def _migrate(self, room: Room, children: ChildStreams, state: _MergeState,
                       targets: dict[str, Target], request: _ChildInputs, failure: _Outcome) -> _Outcome:
        """Move the request to a direct decode that resumes from the tokens sent (``migration.py``); returns
        ``failure`` when it did (the merge goes on), else the final error for the client."""
        migration, demand = state.migration, request.demand
        assert failure.culprit is not None
        migration.failed.add(failure.culprit.instance_id)
        await children.cancel_all()   # a prefill still sending KV, or a decode that reported an error
        sent = tuple(migration.token_ids)

        def give_up(why: str) -> _Outcome:
            error = f"{failure.error} ({why})"
            logger.warning("room=%d: not migrated: %s", room, why)
            return _Outcome(final=Delta.failure(error), error=error)

        if migration.num_migrations >= self._config.migration_limit:
            return give_up(f"migrated {migration.num_migrations} times: migration_limit reached")
        if not sent or len(sent) != state.num_output_tokens:
            return give_up(f"the children reported {len(sent)} token ids of {state.num_output_tokens} tokens")
        try:
            target = pick_decode(self._fleet.candidates("decode", frozenset(migration.failed)),
                                 demand.tokens_to_reserve)
        except NoInstance:
            return give_up("no other decode instance to migrate to")
        self._fleet.note_assigned(target, demand.prompt_tokens + len(sent), demand.tokens_to_reserve)
        if self._metrics is not None:
            self._metrics.selected("decode", target.instance_id, target.dp_rank)
            self._metrics.migrated()
        migration.num_migrations += 1
        migration.logprob_base = state.cumulative_logprob
        new_room = self.rooms.allocate()
        state.rooms.append(new_room)
        state.prefill_final, state.decode_final = True, False
        targets.clear()
        targets["decode"] = target
        logger.warning("room=%d: %s; migrating (%d/%d) to decode %s as room=%d with %d tokens sent", room,
                       failure.error, migration.num_migrations, self._config.migration_limit,
                       target.instance_id, new_room, len(sent))
        children.start(ChildCall("decode", target, new_room, "", "", request.forwarded, resume_token_ids=sent,
                                 **self._prompt_ids(request.demand)))
        return failure

    def _prompt_ids(self, demand: Demand) -> dict[str, tuple[int, ...] | str]:
        """The ``prompt_token_ids`` and ``tokenizer_id`` of a child call: the ids the router tokenized, when
        it has them and knows its tokenizer's fingerprint; else nothing (the child tokenizes)."""
        if not (demand.token_ids and self._tokenizer_id):
            return {}
        return {"prompt_token_ids": demand.token_ids, "tokenizer_id": self._tokenizer_id}

    def _accept(self, role: str, response: Delta, state: _MergeState,
                emit: Callable[[Delta], None]) -> None:
        if role == state.prefilled_by:
            for name in _PREFILLED:
                state.carried[name] = max(state.carried[name], getattr(response, name))
        if role == "prefill":
            state.prefill_final = state.prefill_final or response.final
            if not state.first_done and (response.num_output_tokens or response.final):
                state.first_done = True
                self._forward(response, state, emit)
                for held in state.held:
                    self._forward(held, state, emit)
                state.held.clear()
            return
        state.decode_final = state.decode_final or response.final
        state.decode_has_kv = state.decode_has_kv or bool(response.token_ids or response.text
                                                           or response.final)
        if state.first_done:
            self._forward(response, state, emit)
        else:
            state.held.append(response)

    @staticmethod
    def _forward(response: Delta, state: _MergeState, emit: Callable[[Delta], None]) -> None:
        for name in _MAX:
            state.carried[name] = max(state.carried[name], getattr(response, name))
        state.migration.token_ids.extend(response.token_ids)
        if response.num_output_tokens >= state.num_output_tokens:
            state.num_output_tokens = response.num_output_tokens
            # a resumed child counts the tokens it was resumed with as 0.0
            state.cumulative_logprob = state.migration.logprob_base + response.cumulative_logprob
        if response.finish_reason is not None or state.finish_reason is not None:
            # the request's last tokens: they go out with the final chunk
            state.finish_reason = state.finish_reason or response.finish_reason
            state.tail_text += response.text
            if response.logprobs is not None:
                state.tail_logprobs = (state.tail_logprobs or []) + list(response.logprobs)
            return
        if response.text or response.logprobs:
            state.emitted = state.emitted or bool(response.text)
            emit(Delta(text=response.text, num_output_tokens=state.num_output_tokens,
                       cumulative_logprob=state.cumulative_logprob, logprobs=response.logprobs,
                       num_migrations=state.migration.num_migrations,
                       **state.carried))

    def _count_rejected(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.rejected(reason)
