"""The router's choice of DP-attention ranks (``serving.router.ranks``, issue #47 item 2), on the CPU without
a server: the fleet's per-rank view (reported load + this router's own assignments per rank), the rank each
policy pairs a request to, the cache-aware index kept per (instance, rank), a mixed fleet, migration, and the
child request that names the rank.

Invariants: the least-loaded rank is chosen (prefill: fewest queued prompt tokens; decode: most free pages
among the ranks that hold the request); a burst within one load report spreads over the ranks; a prompt whose
prefix was prefilled on rank r goes back to rank r, unless r is busier by more than the hit saves; an
instance of one pool gets no rank, whichever side has DP attention; the chosen rank travels as ``dp_rank``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from router_fakes import fleet_of, status

from bootstrap.messages import InstanceStatus
from serving.child.codec import CHILD_INPUTS
from serving.parsing.pd_request import parse_pd_request
from serving.router.fleet import Fleet, RankLoad
from serving.router.launch import ChildCall, child_arrays
from serving.router.migration import pick_decode
from serving.router.pairing import CacheAwarePairing, Demand, LoadAwarePairing, Pair, RoundRobinPairing


def dp(instance_id: str, role: str, free: list[int], queued: list[int] | None = None) -> InstanceStatus:
    """A DP-attention instance of ``len(free)`` ranks of 100 pages each (page size 16)."""
    queued = queued or [0] * len(free)
    base = status(instance_id, role, free_pages=sum(free), queued_tokens=sum(queued))
    load = dataclasses.replace(base.load, num_total_pages=100 * len(free), rank_free_pages=free,
                               rank_queued_prompt_tokens=queued)
    return dataclasses.replace(base, load=load)


def choose(policy, fleet: Fleet, demand: Demand) -> Pair:
    """What ``PDOrchestrator._choose`` does: the policy's pair, each target noted as assigned."""
    pair = policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"), demand)
    for target in (pair.prefill, pair.decode):
        if target is not None:
            fleet.note_assigned(target, demand.prompt_tokens,
                                demand.tokens_to_reserve if target.role == "decode" else demand.prompt_tokens)
    return pair


def prompt(seed: int, tokens: int = 200) -> Demand:
    ids = tuple(1000 * seed + i for i in range(tokens))
    return Demand(len(ids), 16, ids)


def test_the_least_loaded_rank_is_chosen_on_each_side() -> None:
    fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100], queued=[500, 30]),
                     dp("d0@h:1", "decode", [10, 60]))
    for policy in (LoadAwarePairing(), CacheAwarePairing(), RoundRobinPairing()):
        pair = policy.choose(fleet.candidates("prefill"), fleet.candidates("decode"), Demand(100, 100))
        assert pair.prefill is not None and (pair.prefill.dp_rank, pair.decode.dp_rank) == (1, 1), policy


def test_a_decode_rank_that_cannot_hold_the_request_is_passed_over_for_one_that_can() -> None:
    """13 pages: rank 0 (12 free, nothing queued) cannot take them; rank 1 (20 free) can."""
    fleet = fleet_of(status("p0@h:1", "prefill"), dp("d0@h:1", "decode", [12, 20], queued=[0, 900]))
    assert LoadAwarePairing().choose(fleet.candidates("prefill"), fleet.candidates("decode"),
                                     Demand(100, 100)).decode.dp_rank == 1


def test_a_burst_within_one_load_report_spreads_over_the_ranks() -> None:
    """Eight requests before the instances report again: the router's own assignments count per rank."""
    fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100]), dp("d0@h:1", "decode", [100, 100]))
    policy = LoadAwarePairing()
    pairs = [choose(policy, fleet, Demand(64, 32)) for _ in range(8)]
    for role in ("prefill", "decode"):
        ranks = [getattr(p, role).dp_rank for p in pairs]
        assert sorted(ranks) == [0] * 4 + [1] * 4, (role, ranks)
    decode = fleet.candidates("decode")[0]
    # each rank: 4 prompts of 64 tokens queued, 4 x 6 pages reserved (64 + 32 - 1 tokens)
    assert decode.ranks == (RankLoad(100 - 4 * 6, 4 * 64), RankLoad(100 - 4 * 6, 4 * 64))


def test_an_ended_request_gives_its_rank_back_and_an_unranked_one_holds_pages_on_every_rank() -> None:
    fleet = fleet_of(dp("d0@h:1", "decode", [50, 50]))
    target = dataclasses.replace(fleet.candidates("decode")[0].target, dp_rank=1)
    fleet.note_assigned(target, 64, 160)                       # 10 pages on rank 1
    assert fleet.candidates("decode")[0].ranks == (RankLoad(50, 0), RankLoad(40, 64))
    fleet.note_finished(target, 64, 160)
    assert fleet.candidates("decode")[0].ranks == (RankLoad(50, 0), RankLoad(50, 0))
    unranked = dataclasses.replace(target, dp_rank=None)    # the instance places it: any rank may hold it
    fleet.note_assigned(unranked, 64, 160)
    decode = fleet.candidates("decode")[0]
    assert decode.ranks == (RankLoad(40, 0), RankLoad(40, 0)) and decode.largest_free_pages == 40


def test_a_prompt_goes_back_to_the_rank_that_prefilled_its_prefix() -> None:
    fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100]), dp("d0@h:1", "decode", [100, 100]))
    policy = CacheAwarePairing()
    first = [choose(policy, fleet, prompt(seed)) for seed in range(2)]   # idle ranks: one each
    assert {p.prefill.dp_rank for p in first} == {0, 1} and {p.decode.dp_rank for p in first} == {0, 1}
    for turn in range(3):                        # each conversation's next turns: its prompt + more
        for seed, pair in enumerate(first):
            fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100]), dp("d0@h:1", "decode", [100, 100]))
            ids = prompt(seed).token_ids + tuple(range(9000, 9040 + 40 * turn))
            again = choose(policy, fleet, Demand(len(ids), 16, ids))
            assert (again.prefill, again.decode) == (pair.prefill, pair.decode), (turn, seed)


def test_a_ranks_hit_is_weighed_against_its_queue() -> None:
    """Rank 0 holds 12 pages (192 tokens) of the prompt: a 100-token queue there does not send it away, a
    1000-token one does (the other rank is idle)."""
    policy = CacheAwarePairing()
    warm = fleet_of(dp("p0@h:1", "prefill", [100, 100], queued=[0, 10 ** 6]), status("d0@h:1", "decode"))
    assert choose(policy, warm, prompt(7)).prefill.dp_rank == 0
    for queued, expected in ((100, 0), (1000, 1)):
        fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100], queued=[queued, 0]), status("d0@h:1", "decode"))
        assert choose(policy, fleet, prompt(7)).prefill.dp_rank == expected, queued


def test_a_mixed_fleet_names_a_rank_only_on_its_dp_side() -> None:
    for p_ranks, d_ranks in ((2, 0), (0, 2)):
        p = dp("p0@h:1", "prefill", [100] * p_ranks) if p_ranks else status("p0@h:1", "prefill")
        d = dp("d0@h:1", "decode", [100] * d_ranks) if d_ranks else status("d0@h:1", "decode")
        fleet = fleet_of(p, d)
        for policy in (LoadAwarePairing(), CacheAwarePairing(), RoundRobinPairing()):
            pairs = [choose(policy, fleet, prompt(seed)) for seed in range(4)]
            assert {x.prefill.dp_rank for x in pairs} == ({0, 1} if p_ranks else {None}), policy
            assert {x.decode.dp_rank for x in pairs} == ({0, 1} if d_ranks else {None}), policy
            for role, target in (("prefill", pairs[0].prefill), ("decode", pairs[0].decode)):
                arrays = child_arrays(ChildCall(role, target, 5, "", "", {"text_input": "hi"}))
                assert ("dp_rank" in arrays) == (target.dp_rank is not None)


def test_the_chosen_rank_travels_as_the_dp_rank_input_and_parses_back() -> None:
    fleet = fleet_of(dp("p0@h:1", "prefill", [100, 100], queued=[9, 0]), dp("d0@h:1", "decode", [9, 90]))
    pair = LoadAwarePairing().choose(fleet.candidates("prefill"), fleet.candidates("decode"), Demand(16, 16))
    assert pair.prefill is not None
    for role, target in (("prefill", pair.prefill), ("decode", pair.decode)):
        arrays = child_arrays(ChildCall(role, target, 5, "", "", {"text_input": "hi"}))
        assert arrays["dp_rank"].dtype == np.int32 and CHILD_INPUTS["dp_rank"][0] == "TYPE_INT32"
        llm = {"text_input": b"hi"}
        pd_inputs = {name: arrays[name] for name in ("bootstrap_room", "dp_rank")}
        assert parse_pd_request(llm, pd_inputs).dp_rank == target.dp_rank == 1


def test_a_migrated_request_goes_to_the_roomiest_rank_of_its_new_decode() -> None:
    fleet = fleet_of(dp("d0@h:1", "decode", [30, 80]), status("d1@h:1", "decode", free_pages=60))
    target = pick_decode(fleet.candidates("decode"), 200)
    assert (target.instance_id, target.dp_rank) == ("d0@h:1", 1)
    target = pick_decode(fleet.candidates("decode", frozenset({"d0@h:1"})), 200)
    assert (target.instance_id, target.dp_rank) == ("d1@h:1", None)
