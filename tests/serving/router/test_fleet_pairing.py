"""Fleet health (freshness, circuit breakers, static lists), the pairing policies and admission; one invariant
a test, all on the CPU without a server."""

from __future__ import annotations

import asyncio

import pytest
from router_fakes import fleet_of, status

from serving.router.admission import Admission, ServerBusy
from serving.router.config import RouterConfig
from serving.router.fleet import FleetSnapshot
from serving.router.pairing import (
    CacheAwarePairing,
    Demand,
    LoadAwarePairing,
    NoInstance,
    PrefixIndex,
    RoundRobinPairing,
)


def ids(candidates) -> list[str]:
    return [c.target.instance_id for c in candidates]


def test_stale_instances_are_out_of_rotation_until_heard_from_again() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill", age_s=5.0))
    assert ids(fleet.candidates("prefill")) == ["p0@h:1"]
    fleet.update(FleetSnapshot((status("p1@h:1", "prefill", age_s=0.1),), taken_s=100.0))
    assert ids(fleet.candidates("prefill")) == ["p1@h:1"]


def test_the_breaker_opens_after_consecutive_failures_and_a_trial_closes_it() -> None:
    clock = [100.0]
    config = RouterConfig(breaker_failures=2, breaker_cooldown_s=5.0)
    both = (status("d0@h:1", "decode"), status("d1@h:1", "decode"))
    fleet = fleet_of(*both, config=config, now=lambda: clock[0])
    target = fleet.candidates("decode")[0].target
    fleet.record(target, ok=False)
    assert ids(fleet.candidates("decode")) == ["d0@h:1", "d1@h:1"]     # one failure: still in rotation
    fleet.record(target, ok=False)
    assert ids(fleet.candidates("decode")) == ["d1@h:1"] and fleet.health()["decode"]["d0@h:1"] is False
    clock[0] += 5.0
    fleet.update(FleetSnapshot(both, taken_s=clock[0]))
    assert ids(fleet.candidates("decode")) == ["d0@h:1", "d1@h:1"]     # cooled down: one trial
    fleet.note_assigned(target, 10, 10)
    assert ids(fleet.candidates("decode")) == ["d1@h:1"]               # the trial is in flight
    fleet.record(target, ok=True)
    assert ids(fleet.candidates("decode")) == ["d0@h:1", "d1@h:1"]


def test_when_every_breaker_is_open_the_fresh_instances_are_used_anyway() -> None:
    """Panic mode: failing instances that still heartbeat beat refusing every request; stale ones stay out."""
    fleet = fleet_of(status("d0@h:1", "decode"), status("d1@h:1", "decode", age_s=9.0),
                     config=RouterConfig(breaker_failures=1))
    fleet.record(fleet.candidates("decode")[0].target, ok=False)
    assert ids(fleet.candidates("decode")) == ["d0@h:1"] and fleet.health()["decode"] == {"d0@h:1": False,
                                                                                        "d1@h:1": False}


def test_a_restarted_instance_gets_a_fresh_breaker() -> None:
    config = RouterConfig(breaker_failures=1)
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), config=config)
    fleet.record(fleet.candidates("prefill")[0].target, ok=False)
    assert ids(fleet.candidates("prefill")) == ["p1@h:1"]
    fleet.update(FleetSnapshot((status("p0@h:1", "prefill", epoch=2), status("p1@h:1", "prefill")),
                               taken_s=100.0))
    assert ids(fleet.candidates("prefill")) == ["p0@h:1", "p1@h:1"]


def test_a_static_list_restricts_the_fleet_to_its_entries() -> None:
    config = RouterConfig(grpc_url="127.0.0.1:8001", prefill_models="prefill_1")
    fleet = fleet_of(status("prefill@127.0.0.1:8001", "prefill"),
                     status("prefill_1@127.0.0.1:8001", "prefill"),
                     config=config)
    assert ids(fleet.candidates("prefill")) == ["prefill_1@127.0.0.1:8001"]


def test_router_assignments_count_until_the_next_report() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=100))
    target = fleet.candidates("prefill")[0].target
    fleet.note_assigned(target, 500, 500)
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 600
    fleet.update(FleetSnapshot((status("p0@h:1", "prefill", queued_tokens=650),), taken_s=101.0))
    fleet._now = lambda: 101.0   # a report newer than the assignment replaces it
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 650


def test_an_assignment_stops_counting_when_its_request_ended_before_the_next_report() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=0))
    target = fleet.candidates("prefill")[0].target
    fleet.note_assigned(target, 500, 500)
    fleet.note_assigned(target, 300, 300)
    fleet.note_finished(target, 500, 500)
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 300   # the other one still counts
    fleet.note_finished(target, 500, 500)   # already gone: nothing else is taken
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 300


def test_a_request_that_ended_after_the_last_report_leaves_that_report_until_a_newer_one() -> None:
    """The report was taken while the request was queued (prefill) or held its pages (decode); it ended after:
    its tokens leave the queue and its pages come back (floored, capped) until a report taken after the
    end."""
    clock = [100.0]
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=500),
                     status("d0@h:1", "decode", free_pages=60),
                     now=lambda: clock[0])
    prefill, decode = fleet.candidates("prefill")[0].target, fleet.candidates("decode")[0].target
    clock[0] = 99.0   # both were assigned before the report (taken at 100.0), which counts them
    fleet.note_assigned(prefill, 500, 500)
    fleet.note_assigned(decode, 500, 640)
    clock[0] = 100.5
    fleet.note_finished(prefill, 500, 500)
    fleet.note_finished(decode, 500, 640)
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 0
    assert fleet.candidates("decode")[0].free_pages == 100            # 60 + 40 pages, at most the pool's 100
    # a second end of the same size: floored
    fleet.note_finished(prefill, 500, 500)
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 0
    fleet.update(FleetSnapshot((status("p0@h:1", "prefill", queued_tokens=300),
                                status("d0@h:1", "decode", free_pages=70)), taken_s=101.0))
    clock[0] = 101.0   # a report taken after the ends: its numbers stand
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 300
    assert fleet.candidates("decode")[0].free_pages == 70


def test_an_end_on_a_restarted_instance_does_not_correct_the_new_one() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=500))
    old = fleet.candidates("prefill")[0].target
    fleet.update(FleetSnapshot((status("p0@h:1", "prefill", queued_tokens=500, epoch=2),), taken_s=99.0))
    assert fleet.candidates("prefill")[0].target.epoch == 2
    fleet.note_finished(old, 500, 500)
    assert fleet.candidates("prefill")[0].queued_prompt_tokens == 500


def test_cache_aware_sends_the_next_turn_back_while_the_report_still_counts_the_last_one() -> None:
    """The live failure this guards: turn k's prefill was in p0's last report; turn k+1 came before the
    next."""
    clock = [100.0]
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"),
                     now=lambda: clock[0])
    policy = CacheAwarePairing()
    turn = list(range(1, 513))
    first = policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"),
                          Demand(len(turn), 16, tuple(turn)))
    assert first.prefill is not None
    clock[0] = 100.2
    fleet.note_assigned(first.prefill, len(turn), len(turn))
    fleet.update(FleetSnapshot((status(first.prefill.instance_id, "prefill", queued_tokens=900),
                                status(
                                    "p0@h:1"
                                        if first.prefill.instance_id == "p1@h:1" else "p1@h:1", "prefill"),
                                status("d0@h:1", "decode")), taken_s=100.3))
    clock[0] = 100.6
    fleet.note_finished(first.prefill, len(turn), len(turn))
    turn += list(range(600, 620))
    second = policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"),
                           Demand(len(turn), 16, tuple(turn)))
    assert second.prefill == first.prefill


def test_load_aware_picks_least_queued_prefill_and_roomiest_decode_that_fits() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=900),
                     status("p1@h:1", "prefill", queued_tokens=10),
                     status("d0@h:1", "decode", free_pages=40), status("d1@h:1", "decode", free_pages=30))
    pair = LoadAwarePairing().choose(fleet.candidates("prefill"), fleet.candidates("decode"),
                                     Demand(100, 100))
    assert pair.prefill is not None and pair.prefill.instance_id == "p1@h:1"
    assert pair.decode.instance_id == "d0@h:1"


def test_load_aware_spreads_an_idle_fleet() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"),
                     status("d1@h:1", "decode"))
    policy = LoadAwarePairing()
    picks = [policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"), Demand(16, 16))
             for _ in range(4)]
    assert {p.prefill.instance_id for p in picks if p.prefill} == {"p0@h:1", "p1@h:1"}
    assert {p.decode.instance_id for p in picks} == {"d0@h:1", "d1@h:1"}


def test_round_robin_cycles_and_direct_decode_skips_prefill() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"))
    policy = RoundRobinPairing(direct_decode_max_tokens=32)
    prefills, decodes = fleet.candidates("prefill"), fleet.candidates("decode")
    long = [policy.choose(prefills, decodes, Demand(64, 8)) for _ in range(4)]
    assert [p.prefill.instance_id for p in long if p.prefill] == ["p0@h:1", "p1@h:1", "p0@h:1", "p1@h:1"]
    assert policy.choose(prefills, decodes, Demand(8, 8)).prefill is None


def prompt(shared: int, own: int, seed: int) -> Demand:
    """A prompt of ``shared`` common tokens (a system prompt) and ``own`` tokens of its own."""
    ids = tuple(range(1, shared + 1)) + tuple(1000 * seed + i for i in range(own))
    return Demand(len(ids), 16, ids)


def choose(policy, fleet, demand):
    return policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"), demand)


def test_cache_aware_sends_a_conversation_back_where_its_prefix_is() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill"), status("d0@h:1", "decode"),
                     status("d1@h:1", "decode"))
    policy = CacheAwarePairing()
    first = [choose(policy, fleet, prompt(0, 200, seed)) for seed in range(2)]   # an idle fleet: spread
    assert {p.prefill.instance_id for p in first} == {"p0@h:1", "p1@h:1"}
    for seed, pair in enumerate(first):     # the next turn of each conversation: its earlier turn + more
        ids = prompt(0, 200, seed).token_ids + tuple(range(5000, 5040))
        again = choose(policy, fleet, Demand(len(ids), 16, ids))
        assert (again.prefill, again.decode) == (pair.prefill, pair.decode)


def test_cache_aware_weighs_the_hit_against_the_queue() -> None:
    """Prefill: queued tokens minus the tokens a hit skips. A 192-token hit beats a 100-token queue, not a
    1000-token one."""
    policy = CacheAwarePairing()
    warm = fleet_of(status("p0@h:1", "prefill"), status("p1@h:1", "prefill", queued_tokens=10 ** 6),
                    status("d0@h:1", "decode"))
    assert choose(policy, warm, prompt(200, 8, 0)).prefill.instance_id == "p0@h:1"   # p0 now holds the prefix
    for queued, expected in ((100, "p0@h:1"), (1000, "p1@h:1")):
        fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=queued), status("p1@h:1", "prefill"),
                         status("d0@h:1", "decode"))
        assert choose(policy, fleet, prompt(200, 8, 1)).prefill.instance_id == expected


def test_cache_aware_decode_counts_hit_pages_as_free_and_memory_still_decides() -> None:
    policy = CacheAwarePairing()
    d0 = status("d0@h:1", "decode", free_pages=100)
    fleet = fleet_of(status("p0@h:1", "prefill"), d0, status("d1@h:1", "decode", free_pages=10))
    assert choose(policy, fleet, prompt(320, 8, 0)).decode.instance_id == "d0@h:1"
    # d1 has far more free pages now: the 20-page hit on d0 does not outweigh 400 free pages
    fleet = fleet_of(status("p0@h:1", "prefill"), status("d0@h:1", "decode", free_pages=100),
                     status("d1@h:1", "decode", free_pages=500))
    assert choose(policy, fleet, prompt(320, 8, 1)).decode.instance_id == "d1@h:1"
    # near a tie the hit decides; and with the hit's 20 pages shared, 22 pages fit in 10 free ones
    demand = prompt(320, 8, 2)   # 328 prompt + 15 output tokens: 22 pages, the first 20 shareable
    for d0_free, d1_free in ((30, 40), (10, 20)):
        policy = CacheAwarePairing()
        fleet = fleet_of(status("p0@h:1", "prefill"), status("d0@h:1", "decode", free_pages=d0_free),
                         status("d1@h:1", "decode", free_pages=d1_free))
        d0 = next(c.target for c in fleet.candidates("decode") if c.target.instance_id == "d0@h:1")
        policy.index.record(d0, demand.cacheable_page_keys(16))
        assert choose(policy, fleet, demand).decode.instance_id == "d0@h:1"


def test_cache_aware_without_token_ids_is_load_aware() -> None:
    fleet = fleet_of(status("p0@h:1", "prefill", queued_tokens=900),
                     status("p1@h:1", "prefill", queued_tokens=10),
                     status("d0@h:1", "decode", free_pages=40), status("d1@h:1", "decode", free_pages=30))
    pair = choose(CacheAwarePairing(), fleet, Demand(100, 100))
    assert pair.prefill.instance_id == "p1@h:1" and pair.decode.instance_id == "d0@h:1"


def test_prefix_index_is_bounded_matches_from_the_first_page_and_forgets_a_restart() -> None:
    from serving.router.fleet import Target

    index = PrefixIndex(max_pages_per_instance=3)
    t = Target("d0@h:1", "decode", "h:1", "d0", epoch=1)
    restarted = Target("d0@h:1", "decode", "h:1", "d0", 2)
    keys = prompt(0, 5 * 16 + 1, 0).cacheable_page_keys(16)
    assert len(keys) == 5   # 81 tokens: 5 full pages, all shareable (the last token is on page 6)
    index.record(t, keys[:2])
    assert index.hit_pages(t, keys) == 2 and index.hit_pages(t, [keys[2], keys[0]]) == 0   # a leading run
    index.record(t, keys[2:4])    # 4 keys > 3: the least recently sent (the first page) goes
    assert index.hit_pages(t, keys) == 0
    assert index.hit_pages(restarted, keys[1:]) == 0 and index.hit_pages(t, keys[1:]) == 3
    assert prompt(0, 16, 0).cacheable_page_keys(16) == []   # one page: its last token is always computed


def test_no_candidate_is_a_typed_error_naming_the_role() -> None:
    fleet = fleet_of(status("d0@h:1", "decode"))
    with pytest.raises(NoInstance, match="prefill"):
        LoadAwarePairing().choose(fleet.candidates("prefill"), fleet.candidates("decode"), Demand(8, 8))


def test_admission_bounds_inflight_and_queue_then_refuses() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_inflight=2, max_queued=1, queue_timeout_s=0.2)
        results: list[str] = []
        release = asyncio.Event()

        async def one(name: str) -> None:
            try:
                async with admission.admit():
                    results.append(f"{name}:in")
                    await release.wait()
            except ServerBusy as e:
                results.append(f"{name}:busy:{'queue_timeout' in str(e)}")

        tasks = [asyncio.ensure_future(one(n)) for n in "abcd"]
        await asyncio.sleep(0.05)
        assert admission.inflight == 2 and admission.queued == 1
        await asyncio.sleep(0.3)           # c waited past queue_timeout_s
        release.set()
        await asyncio.gather(*tasks)
        assert admission.inflight == 0 and admission.queued == 0
        return results

    results = asyncio.run(scenario())
    assert results[:2] == ["a:in", "b:in"] and "d:busy:False" in results and "c:busy:True" in results


def test_a_dp_instance_fits_a_request_only_in_one_ranks_free_pages() -> None:
    """A DP-attention decode reports 40 free pages as 20 + 20 (``rank_free_pages``): a 25-page request fits
    only the one-pool decode with 30; a 13-page one fits both and goes to the roomier DP instance."""
    import dataclasses

    dp = status("d0@h:1", "decode", free_pages=40)
    dp = dataclasses.replace(dp, load=dataclasses.replace(dp.load, rank_free_pages=[20, 20]))
    fleet = fleet_of(status("p0@h:1", "prefill"), dp, status("d1@h:1", "decode", free_pages=30))
    decodes = {c.target.instance_id: c for c in fleet.candidates("decode")}
    assert decodes["d0@h:1"].largest_free_pages == 20 and decodes["d1@h:1"].largest_free_pages is None
    assert not decodes["d0@h:1"].fits(25) and decodes["d1@h:1"].fits(25)
    policy = LoadAwarePairing()
    prefills, decodes = fleet.candidates("prefill"), fleet.candidates("decode")
    big = policy.choose(prefills, decodes, Demand(300, 100))   # 25 pages
    assert big.decode.instance_id == "d1@h:1"
    small = policy.choose(prefills, decodes, Demand(100, 100))  # 13 pages
    assert small.decode.instance_id == "d0@h:1"
