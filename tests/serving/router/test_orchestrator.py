"""PDOrchestrator: one request's merge, failover and cancellation, over a scripted launcher; one invariant a
test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from router_fakes import Script, ScriptedLauncher, fleet_of, status, unavailable

from serving.delta import Delta, ErrorKind
from serving.parsing.request import GenerateRequest
from serving.router.config import RouterConfig
from serving.router.launch import ChildCall
from serving.router.orchestrator import PDOrchestrator, RoomAllocator, RoutedRequest
from serving.router.pairing import make_policy

FLEET = (status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"))


def tok(text: str, n: int, final: bool = False, finish_reason: str | None = None) -> Delta:
    return Delta(text=text, num_input_tokens=7, num_output_tokens=n, final=final,
                         finish_reason=finish_reason)


OK_PREFILL = [(0.0, tok("A", 1)), (0.0, Delta(final=True))]
OK_DECODE = [(0.0, tok("B", 2)), (0.0, tok("C", 3, final=True, finish_reason="length"))]


def run(launcher: ScriptedLauncher, cancel_after_s: float | None = None, fleet=None, linger_s: float = 0.0,
        **config: object) -> tuple[list[Delta], ScriptedLauncher]:
    """One request through a ``PDOrchestrator`` over ``launcher``; ``launcher.cancelled_when_done`` is its
    ``cancelled`` when the request ended, and the event loop then runs ``linger_s`` longer (streams the router
    left to end by themselves end) before ``asyncio.run`` cancels what is left."""
    cfg = RouterConfig(**{"policy": "round_robin", **config})  # type: ignore[arg-type]
    orchestrator = PDOrchestrator(cfg, fleet or fleet_of(*FLEET, config=cfg),
                                  make_policy(cfg.policy, cfg.direct_decode_max_tokens), launcher,
                                  lambda request: 7)
    out: list[Delta] = []
    start = time.monotonic()

    def cancelled() -> bool:
        return cancel_after_s is not None and time.monotonic() - start > cancel_after_s

    routed = RoutedRequest(GenerateRequest(prompt="hi"), {"text_input": b"hi"})

    async def request() -> None:
        await orchestrator.generate(routed, out.append, cancelled)
        launcher.cancelled_when_done = list(launcher.cancelled)
        await asyncio.sleep(linger_s)

    asyncio.run(request())
    assert sum(c.final for c in out) == 1 and out[-1].final, "exactly one final chunk, last"
    assert len(orchestrator.rooms) == 0
    return out, launcher


def test_first_token_comes_first_even_when_decode_answers_earlier() -> None:
    launcher = ScriptedLauncher({"prefill": [(0.1, tok("A", 1)), (0.0, Delta(final=True))],
                                 "decode": OK_DECODE})
    out, _ = run(launcher)
    assert [c.text for c in out] == ["A", "B", "C"]   # the last tokens come with the final chunk
    assert out[-1].finish_reason == "length" and (out[-1].num_input_tokens,
                                                  out[-1].num_output_tokens) == (7, 3)
    rooms = {c.room for c in launcher.calls}
    assert len(rooms) == 1 and launcher.cancelled == []
    decode = next(c for c in launcher.calls if c.role == "decode")
    prefill = next(c for c in launcher.calls if c.role == "prefill")
    assert decode.prefill_instance == prefill.target.instance_id
    assert decode.prefill_rendezvous == prefill.target.rendezvous_url == "http://p0:1"   # in-band rendezvous


def test_a_prefill_that_fails_before_the_first_token_is_retried_once_on_another_pair() -> None:
    launcher = ScriptedLauncher({"prefill": OK_PREFILL, "decode": OK_DECODE},
                                by_instance={"p0@h:1": [(0.0, unavailable())]})
    out, _ = run(launcher)
    assert out[-1].error is None and [c.text for c in out] == ["A", "B", "C"]
    prefills = [c.target.instance_id for c in launcher.calls if c.role == "prefill"]
    assert prefills == ["p0@h:1", "p1@h:1"]
    rooms = [c.room for c in launcher.calls if c.role == "prefill"]
    # the failed pair's decode
    assert rooms[0] != rooms[1] and [c.room for c in launcher.cancelled] == [rooms[0]]


def test_without_migration_a_failure_after_the_first_token_ends_the_request_with_the_error() -> None:
    launcher = ScriptedLauncher({"prefill": OK_PREFILL,
                                 "decode": [(0.05, tok("B", 2)),
                                            (0.0, Delta(error="decode died", final=True))]})
    out, _ = run(launcher, migration_limit=0)
    assert [c.text for c in out if not c.final] == ["A", "B"] and out[-1].error == "decode died"
    assert len({c.room for c in launcher.calls}) == 1


def test_with_no_other_pair_left_the_error_reaches_the_client() -> None:
    """The only prefill refuses twice (the second time on a new connection: it answers its rendezvous, so it
    was the router's last resort): the client gets the failure, naming the missing second instance."""
    launcher = ScriptedLauncher({"prefill": [(0.0, unavailable("p down"))], "decode": OK_DECODE})
    out, _ = run(launcher, fleet=fleet_of(FLEET[0], FLEET[2]), max_retries=2)
    assert (out[-1].error or "").startswith("p down") and "no other prefill" in (out[-1].error or "")
    assert [c.target.instance_id for c in launcher.calls if c.role == "prefill"] == ["p0@h:1", "p0@h:1"]


def test_retries_zero_means_the_first_failure_is_final() -> None:
    launcher = ScriptedLauncher({"prefill": [(0.0, unavailable("p down"))], "decode": OK_DECODE})
    out, _ = run(launcher, max_retries=0)
    assert "p down" in (out[-1].error or "") and len([c for c in launcher.calls if c.role == "prefill"]) == 1


def test_client_cancel_aborts_the_room_and_cancels_both_streams() -> None:
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1))], "decode": [(5.0, tok("B", 2, final=True))]})
    start = time.monotonic()
    out, _ = run(launcher, cancel_after_s=0.1)
    assert time.monotonic() - start < 3.0 and out[-1].finish_reason == "abort"
    assert {c.role for c in launcher.cancelled} == {"prefill", "decode"}


def test_children_that_go_silent_end_the_request_after_the_idle_timeout() -> None:
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1))],
                                 "decode": [(30.0, tok("B", 2, final=True))]})
    start = time.monotonic()
    out, _ = run(launcher, request_idle_timeout_s=0.3)
    assert time.monotonic() - start < 5.0 and "no response" in (out[-1].error or "")
    assert {c.role for c in launcher.cancelled} == {"prefill", "decode"}


def test_a_launcher_bug_is_an_error_for_that_request_not_a_hang() -> None:
    launcher = ScriptedLauncher({"prefill": [(0.0, RuntimeError("bug"))], "decode": OK_DECODE})
    out, _ = run(launcher, max_retries=0)
    assert "bug" in (out[-1].error or "")


def test_direct_decode_sends_a_short_prompt_to_decode_alone() -> None:
    launcher = ScriptedLauncher({"decode": [(0.0, tok("A", 1)),
                                            (0.0, tok("B", 2, final=True, finish_reason="stop"))]})
    out, _ = run(launcher, direct_decode_max_tokens=8)
    assert [c.role for c in launcher.calls] == ["decode"] and launcher.calls[0].prefill_instance == ""
    assert [c.text for c in out if c.text] == ["A", "B"] and out[-1].finish_reason == "stop"


def test_rooms_are_unique_63_bit_and_released() -> None:
    rooms = RoomAllocator()
    got = {rooms.allocate() for _ in range(1000)}
    assert len(got) == 1000 and all(0 <= r < 2**63 for r in got)
    for r in got:
        rooms.release(r)
    assert len(rooms) == 0


def test_an_error_about_the_request_is_neither_retried_nor_held_against_the_instance() -> None:
    rejected = "request 'decode-3' rejected: needs 7000 pages, the pool has 1024"
    launcher = ScriptedLauncher({"prefill": OK_PREFILL, "decode": [
        (0.0, Delta(error=rejected, final=True, error_kind=ErrorKind.REQUEST))]})
    fleet = fleet_of(*FLEET, config=RouterConfig(breaker_failures=1))
    for _ in range(3):
        out, _ = run(launcher, fleet=fleet)
        assert out[-1].error == rejected
    assert len([c for c in launcher.calls if c.role == "decode"]) == 3   # one attempt each
    assert fleet.health()["decode"] == {"d0@h:1": True}   # still in rotation


def test_the_error_kind_decides_the_retry_not_the_message() -> None:
    """The same words from an instance that failed (``INSTANCE``, the default) are retried on another pair."""
    looks_like_a_request_error = "invalid input 'text_input': the prefill engine step failed on it"
    launcher = ScriptedLauncher({"prefill": OK_PREFILL, "decode": OK_DECODE}, by_instance={
        "p0@h:1": [(0.0, Delta(error=looks_like_a_request_error, final=True))]})
    out, _ = run(launcher)
    assert [c.target.instance_id for c in launcher.calls if c.role == "prefill"] == ["p0@h:1", "p1@h:1"]
    assert "".join(c.text for c in out) == "ABC" and out[-1].error is None


def test_the_prompts_cache_hit_is_prefills_on_every_chunk_and_decodes_is_ignored() -> None:
    prefill = [(0.0, Delta(text="A", num_input_tokens=64, num_output_tokens=1, num_cached_tokens=16)),
               (0.0, Delta(final=True))]   # its last response says 0: the first one counts
    decode = [(0.0, Delta(text="B", num_input_tokens=64, num_output_tokens=2, num_cached_tokens=48)),
              (0.0, Delta(text="C", num_input_tokens=64, num_output_tokens=3, final=True,
                                  finish_reason="length", num_cached_tokens=48))]
    out, _ = run(ScriptedLauncher({"prefill": prefill, "decode": decode}))
    assert [c.text for c in out] == ["A", "B", "C"] and [c.num_cached_tokens for c in out] == [16, 16, 16]


def test_a_direct_decode_reports_decodes_own_cache_hit() -> None:
    decode = [(0.0, Delta(text="A", num_input_tokens=7, num_output_tokens=1, num_cached_tokens=16)),
              (0.0, Delta(text="B", num_input_tokens=7, num_output_tokens=2, final=True,
                                  finish_reason="stop", num_cached_tokens=16))]
    launcher = ScriptedLauncher({"decode": decode})
    out, _ = run(launcher, direct_decode_max_tokens=8)
    assert [c.role for c in launcher.calls] == ["decode"] and [c.num_cached_tokens for c in out] == [16, 16]


def test_a_retry_avoids_the_failed_pairs_partner_when_the_fleet_has_another() -> None:
    """A decode reports its room failed because its prefill died (the decode's error arrives first, so the
    decode is the culprit): the retry takes neither instance of that pair, not the dead prefill again."""
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill", queued_tokens=1000),
                     status("d0@h:1", "decode", free_pages=200), status("d1@h:1", "decode"))
    launcher = ScriptedLauncher({"prefill": OK_PREFILL, "decode": OK_DECODE},
                                by_instance={"p0@h:1": [(0.05, unavailable("p0 down"))],
                                             "d0@h:1": [(0.0, Delta(error="KV transfer failed: prefill p0 "
                                                                                  "went away", final=True))]})
    out, _ = run(launcher, fleet=fleet, policy="load_aware")   # load_aware prefers p0 and d0
    assert out[-1].error is None and [c.text for c in out] == ["A", "B", "C"]
    pairs = [c.target.instance_id for c in launcher.calls]
    assert pairs[:2] == ["p0@h:1", "d0@h:1"] and sorted(pairs[2:]) == ["d1@h:1", "p1@h:1"], pairs


def test_an_instance_that_answers_its_rendezvous_is_retried_last_after_a_connection_failure() -> None:
    """The router's connection to the only decode failed (a stale one: the server restarted on the same
    address, or the path came back after a partition) while the fleet still hears the instance: the retry
    takes it again, on a new connection, rather than failing for want of another decode."""
    prefill = [(0.05, tok("A", 1)), (0.0, Delta(final=True))]
    launcher = ScriptedLauncher({"prefill": prefill, "decode": OK_DECODE},
                                by_instance={"d0@h:1": [(0.0, unavailable("Stream removed"))]})
    first_call = launcher.stream

    def stale_once(call):
        if sum(c.target.instance_id == "d0@h:1" for c in launcher.calls) == 1 and call.role == "decode":
            launcher.by_instance.clear()   # the new connection works
        return first_call(call)

    launcher.stream = stale_once   # type: ignore[method-assign]
    out, _ = run(launcher)
    assert out[-1].error is None and [c.text for c in out] == ["A", "B", "C"]
    decodes = [c.target.instance_id for c in launcher.calls if c.role == "decode"]
    prefills = [c.target.instance_id for c in launcher.calls if c.role == "prefill"]
    assert decodes == ["d0@h:1", "d0@h:1"] and prefills == ["p0@h:1", "p1@h:1"]   # the partner still avoided


def test_another_instance_goes_before_the_last_resort_and_a_second_connection_failure_excludes_it() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"))
    launcher = ScriptedLauncher({"prefill": OK_PREFILL, "decode": OK_DECODE},
                                by_instance={"p0@h:1": [(0.0, unavailable("p0 refused"))],
                                             "p1@h:1": [(0.0, unavailable("p1 refused"))]})
    out, _ = run(launcher, fleet=fleet, max_retries=3)
    prefills = [c.target.instance_id for c in launcher.calls if c.role == "prefill"]
    assert prefills == ["p0@h:1", "p1@h:1", "p0@h:1", "p1@h:1"]   # each once more, after the other
    assert "p1 refused" in (out[-1].error or "")


def test_a_child_whose_instance_went_silent_is_given_up_its_connection_reset_and_not_retried() -> None:
    """Before the first token, decode and its rendezvous go silent (a host cut off from the router): after
    ``blip_tolerance_s`` the router gives the stream up, resets its connection to that server (a later request
    connects afresh) and, the instance no longer answering, does not take it again."""
    start = time.monotonic()
    fleet = fleet_of(status("p0@h:1", "prefill", age_s=-1000), status("d0@h:1", "decode"),
                     config=RouterConfig(instance_stale_s=0.3, blip_tolerance_s=0.5),
                     now=lambda: 100.0 + time.monotonic() - start)
    slow = [(1.5, tok("A", 1)), (0.0, Delta(final=True))]
    launcher = ScriptedLauncher({"prefill": slow, "decode": [(1.5, Delta(final=True))]})
    out, _ = run(launcher, fleet=fleet, linger_s=2.0, instance_stale_s=0.3, blip_tolerance_s=0.5,
                 fleet_wait_s=0.5)
    assert "decode d0@h:1 unreachable" in (out[-1].error or "") and "no other decode" in (out[-1].error or "")
    assert time.monotonic() - start < 5.0
    assert [c.role for c in launcher.calls] == ["prefill", "decode"] and launcher.resets == ["127.0.0.1:8001"]


class EpochScripted(ScriptedLauncher):
    """Decode plays ``by_epoch[target.epoch]`` (a reloaded instance keeps its id and gets a new epoch)."""

    def __init__(self, by_epoch: dict[int, Script]) -> None:
        super().__init__({"prefill": [(0.1, tok("A", 1)), (0.0, Delta(final=True))]})   # decode answers first
        self.by_epoch = by_epoch

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        if call.role == "decode":
            self.by_instance[call.target.instance_id] = self.by_epoch[call.target.epoch]
        async for delta in super().stream(call):
            yield delta


def test_a_reloaded_decode_that_failed_the_request_is_taken_again_in_its_new_epoch() -> None:
    """The only decode refuses the request (its model is being unloaded: a reload); the reloaded instance
    joins under the same id with a new epoch within ``fleet_wait_s``: the request waits for it and is served
    there (the old epoch stays excluded)."""
    import threading

    from serving.router.fleet import FleetSnapshot

    cfg = RouterConfig(policy="round_robin", fleet_wait_s=3.0, fleet_refresh_s=0.05)
    fleet = fleet_of(status("p0@h:1", "prefill"), status("d0@h:1", "decode", epoch=1), config=cfg)
    unloading = [(0.0,
                  Delta(error="decode at h:2 is being unloaded", final=True, error_kind=ErrorKind.INSTANCE))]
    launcher = EpochScripted({1: unloading, 2: OK_DECODE})
    reloaded = threading.Timer(0.3, lambda: fleet.update(FleetSnapshot(
        (status("p0@h:1", "prefill"), status("d0@h:1", "decode", epoch=2)), taken_s=100.0)))
    reloaded.start()
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet, fleet_wait_s=3.0, fleet_refresh_s=0.05)
    reloaded.join()
    assert out[-1].error is None and "".join(d.text for d in out) == "ABC"
    assert [(c.role,
             c.target.epoch) for c in launcher.calls if c.role == "decode"] == [("decode", 1), ("decode", 2)]
    assert 0.25 < time.monotonic() - start < 3.0


def test_a_request_that_finds_no_decode_waits_for_one_to_join() -> None:
    """Sent the moment tritonserver says ready, before the router has read its workers: the request waits (up
    to ``fleet_wait_s``) and is served by the decode that joins meanwhile."""
    import threading

    from serving.router.fleet import FleetSnapshot

    cfg = RouterConfig(policy="round_robin", fleet_wait_s=5.0, fleet_refresh_s=0.05)
    fleet = fleet_of(status("p0@h:1", "prefill"), config=cfg)
    joined = threading.Timer(0.3, lambda: fleet.update(FleetSnapshot(FLEET, taken_s=100.0)))
    joined.start()
    start = time.monotonic()
    out, launcher = run(ScriptedLauncher({"prefill": OK_PREFILL, "decode": OK_DECODE}), fleet=fleet,
                        fleet_wait_s=5.0, fleet_refresh_s=0.05)
    joined.join()
    assert out[-1].error is None and "".join(d.text for d in out) == "ABC"
    assert 0.25 < time.monotonic() - start < 3.0
    assert [c.role for c in launcher.calls] == ["prefill", "decode"]


def test_with_no_decode_the_request_fails_after_fleet_wait_s_and_at_once_with_zero() -> None:
    for wait_s, at_least_s, at_most_s in ((0.4, 0.35, 2.0), (0.0, 0.0, 0.2)):
        fleet = fleet_of(status("p0@h:1", "prefill"))
        start = time.monotonic()
        out, launcher = run(ScriptedLauncher({}), fleet=fleet, fleet_wait_s=wait_s, fleet_refresh_s=0.05)
        assert out[-1].error == "no healthy decode instance in the fleet"
        assert at_least_s <= time.monotonic() - start < at_most_s and launcher.calls == []


def test_a_client_that_cancels_while_its_request_waits_for_the_fleet_gets_an_abort() -> None:
    fleet = fleet_of(status("d0@h:1", "decode"))
    start = time.monotonic()
    out, launcher = run(ScriptedLauncher({}), cancel_after_s=0.2, fleet=fleet, fleet_wait_s=10.0,
                        fleet_refresh_s=0.05)
    assert out == [Delta(finish_reason="abort", final=True)] and launcher.calls == []
    assert time.monotonic() - start < 2.0


def test_a_prefill_gone_silent_after_decode_ended_the_request_does_not_fail_it() -> None:
    """The prefill host is cut off from the router after the first token, before its own FINAL (sent once its
    KV transfer settled) arrives; decode, which decoded from that KV, streams to its FINAL: the request ends
    with its finish reason and its last tokens, not with prefill's error, and without waiting on the
    prefill."""
    start = time.monotonic()
    fleet = fleet_of(status("p0@h:1", "prefill"), status("d0@h:1", "decode", age_s=-1000),
                     config=RouterConfig(instance_stale_s=0.3), now=lambda: 100.0 + time.monotonic() - start)
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1)), (30.0, Delta(final=True))],
                                 "decode": OK_DECODE})
    out, _ = run(launcher, fleet=fleet, instance_stale_s=0.3, fleet_wait_s=0.5)
    assert out[-1].error is None and out[-1].finish_reason == "length"
    assert "".join(c.text for c in out) == "ABC"
    assert time.monotonic() - start < 5.0   # not the prefill's FINAL, 30 s later
    assert launcher.resets == ["127.0.0.1:8001"]   # the silent server's connection reset, as for any lost one


def test_a_prefill_error_after_decode_ended_the_request_does_not_fail_it() -> None:
    """Prefill reports a failure (its transfer's last acknowledgment lost, say) after decode streamed the
    request to its FINAL: decode decoded from the prompt's KV, so the client gets the finished request."""
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1)), (0.2, Delta.failure("KV transfer failed"))],
                                 "decode": OK_DECODE})
    out, _ = run(launcher)
    assert out[-1].error is None and out[-1].finish_reason == "length"
    assert "".join(c.text for c in out) == "ABC"


def test_a_prefill_that_dies_while_decode_streams_is_let_go_not_migrated() -> None:
    """The prefill's stream breaks (its server killed) after decode sent tokens of its own: decode had the
    prompt's whole KV, so the request goes on with decode alone, uninterrupted; no migration, no error."""
    decode = [(0.0, tok("B", 2)), (0.3, tok("C", 3)), (0.0, tok("D", 4, final=True, finish_reason="length"))]
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1)), (0.1, unavailable("stream removed"))],
                                 "decode": decode})
    out, launcher = run(launcher, migration_limit=1)
    assert out[-1].error is None and out[-1].finish_reason == "length"
    assert "".join(c.text for c in out) == "ABCD"
    assert [c.role for c in launcher.calls] == ["prefill", "decode"]   # no resumed decode


def test_a_prefill_that_dies_before_its_first_token_arrived_is_retried_though_decode_answered() -> None:
    """Decode's tokens arrive (held: the first token comes from the prefill) but the prefill's stream breaks
    before its first token reached the router: that token is lost with it, so the request is retried on
    another pair (nothing reached the client), not finished by decode alone."""
    launcher = ScriptedLauncher({"decode": OK_DECODE},
                                by_instance={"p0@h:1": [(0.2, unavailable("stream removed"))],
                                             "p1@h:1": OK_PREFILL})
    out, launcher = run(launcher)
    assert out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.role for c in launcher.calls] == ["prefill", "decode", "prefill", "decode"]
