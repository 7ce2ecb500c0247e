"""Contract tests of the KV transfer API, run on every backend (in-process; NIXL and Mooncake across two OS
processes).

Invariants checked after every case: the decode side holds exactly the prefill bytes (every byte of every
page) and the aux data; pages not owned by a room were never written; free-page counts on both sides return to
their start values.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from typing import Any

import pytest
from kv_harness import PAGE_SIZE, wait_for

from kv_transfer import KVPoll

TIMEOUT_S = 10.0
# MC_TRANSFER_TIMEOUT (3 s in conftest; a write took ~5 s) plus slack for a loaded host
STOPPED_BOUND_S = 20.0
_rooms = itertools.count(1000)


def chunk_plan(num_tokens: int, chunk_tokens: int) -> list[tuple[int, bool]]:
    """(pages sent, is_last) per prefill chunk: whole pages only, the partial last page with the last
    chunk."""
    plan, start = [], 0
    while start < num_tokens:
        end = min(start + chunk_tokens, num_tokens)
        is_last = end == num_tokens
        done_pages = -(-end // PAGE_SIZE) if is_last else end // PAGE_SIZE
        plan.append((done_pages - start // PAGE_SIZE, is_last))
        start = end
    return plan


def open_room(prefill: Any, decode: Any, num_tokens: int, scatter: bool = False) -> int:
    room = next(_rooms)
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, num_tokens, scatter)
    prefill.call("open_sender", room, num_tokens, scatter)
    wait_for(lambda: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S,
             "destination at prefill")
    return room


def finish(prefill: Any, decode: Any, room: int) -> None:
    wait_for(lambda: decode.call("poll", room) == KVPoll.Success, TIMEOUT_S, f"room {room} Success at decode")
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Success, TIMEOUT_S,
             f"room {room} Success at prefill")
    assert decode.call("check_bytes", room)
    assert decode.call("aux", room) == (7, -0.25, room)


def assert_pages_back(*sides: Any) -> None:
    """Free pages back at their start value, no stray write, and the manager has closed every room (aux slots
    back too)."""
    for side in sides:
        wait_for(functools.partial(_pages_back, side), TIMEOUT_S, f"{side.instance_id} free pages back")
        assert side.call("untouched")
        wait_for(functools.partial(_rooms_closed, side), TIMEOUT_S, f"{side.instance_id} rooms closed")
        assert side.call("metrics")["free_aux_slots"] == 1024


def _pages_back(side: Any) -> bool:
    return bool(side.call("reap") == side.start_free)


def _rooms_closed(side: Any) -> bool:
    return bool(side.call("metrics")["open_rooms"] == 0)


def transfer(prefill: Any, decode: Any, num_tokens: int, chunk_tokens: int | None = None) -> None:
    room = open_room(prefill, decode, num_tokens)
    for num_pages, is_last in chunk_plan(num_tokens, chunk_tokens or num_tokens):
        prefill.call("send", room, num_pages, is_last)
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode)


def test_chunk_plan_sends_whole_pages_until_the_last_chunk() -> None:
    assert chunk_plan(40, 8) == [(0, False), (1, False), (0, False), (1, False), (1, True)]
    assert sum(n for n, _ in chunk_plan(100, 24)) == 7


@pytest.mark.parametrize("num_tokens", [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1])
def test_prompt_lengths_around_a_page(pair: tuple[Any, Any], num_tokens: int) -> None:
    transfer(*pair, num_tokens)


@pytest.mark.parametrize("num_tokens,chunk_tokens", [(100, 24), (40, 8)])
def test_chunks_with_partial_page_at_chunk_boundary(pair: tuple[Any, Any], num_tokens: int,
                                                    chunk_tokens: int) -> None:
    transfer(*pair, num_tokens, chunk_tokens)


def test_handshake_happens_once_per_peer_not_per_room(make_side: Any) -> None:
    prefill, decode = make_side("prefill"), make_side("decode")
    for num_tokens in (5, 21, 40):
        transfer(prefill, decode, num_tokens)
    assert prefill.call("metrics")["peer_handshakes_total"] == 1
    assert decode.call("metrics")["peer_handshakes_total"] == 1
    assert decode.call("metrics")["transfers_total"] == 3


@pytest.mark.parametrize("num_tokens,cached_tokens,chunk_tokens", [
    (PAGE_SIZE + 1, PAGE_SIZE, None),           # one cached page, the partial last page sent
    (4 * PAGE_SIZE, 3 * PAGE_SIZE, None),       # page-aligned prompt: only its last page moves
    (100, 2 * PAGE_SIZE, 24),                   # chunks: the first ones are all cached (notification only)
    (100, 5 * PAGE_SIZE, 40),                   # a chunk split by the cached boundary
])
def test_decode_cached_prefix_is_skipped(pair: tuple[Any, Any], num_tokens: int, cached_tokens: int,
                                         chunk_tokens: int | None) -> None:
    """Decode holds the first ``cached_tokens`` (its prefix cache) and gives only the rest of its pages:
    prefill is handed every page of the prompt, as always, and sends only the uncached ones, each into its
    right destination page; decode's own pages are never written."""
    prefill, decode = pair
    before = prefill.call("metrics")
    room = next(_rooms)
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, num_tokens, False,
                cached_tokens)
    prefill.call("open_sender", room, num_tokens)
    for num_pages, is_last in chunk_plan(num_tokens, chunk_tokens or num_tokens):
        prefill.call("send", room, num_pages, is_last)
    finish(prefill, decode, room)
    after = prefill.call("metrics")
    assert after["skipped_pages_total"] - before["skipped_pages_total"] == cached_tokens // PAGE_SIZE
    token_bytes = 30 * 2 * 3 * 64 * 4   # SmolLM2 layout, fp32: exactly the KV decode lacked moved
    assert after["kv_bytes_total"] - before["kv_bytes_total"] == (num_tokens - cached_tokens) * token_bytes
    assert_pages_back(prefill, decode)


@pytest.mark.parametrize("claim", [2 * PAGE_SIZE, 5])   # the whole 2-page prompt; not page-aligned
def test_decode_cached_count_that_does_not_fit_fails_before_a_byte_moves(pair: tuple[Any, Any],
                                                                        claim: int) -> None:
    prefill, decode = pair
    room = next(_rooms)
    if claim % PAGE_SIZE:   # refused by the receiver at once
        with pytest.raises(Exception, match="page size"):
            decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 2 * PAGE_SIZE,
                        False, 0, claim)
    else:                   # the receiver cannot know the prompt; prefill refuses the destination
        decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 2 * PAGE_SIZE, False,
                    PAGE_SIZE, claim)
        prefill.call("open_sender", room, 2 * PAGE_SIZE)
        wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "prefill refuses")
        assert "the last page must be sent" in prefill.call("failure", room)
        wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "decode learns it")
    assert decode.call("poll", room) == KVPoll.Failed
    assert_pages_back(prefill, decode)


def test_two_rooms_interleaved(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    room_a = open_room(prefill, decode, 70)
    room_b = open_room(prefill, decode, 90, scatter=True)
    plan_a, plan_b = chunk_plan(70, 32), chunk_plan(90, 32)
    for step in range(max(len(plan_a), len(plan_b))):
        for room, plan in ((room_a, plan_a), (room_b, plan_b)):
            if step < len(plan):
                prefill.call("send", room, *plan[step])
    finish(prefill, decode, room_a)
    finish(prefill, decode, room_b)
    assert_pages_back(prefill, decode)


def test_scattered_room_of_more_runs_than_a_write_keeps_in_flight(pair: tuple[Any, Any]) -> None:
    """40 pages reversed at decode: 40 runs and the aux slot, more than Mooncake keeps in flight at once
    (``mooncake_transport.WINDOW``), as one chunk."""
    prefill, decode = pair
    num_tokens = 40 * PAGE_SIZE - 5
    room = open_room(prefill, decode, num_tokens, scatter=True)
    prefill.call("send", room, 40, True)
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode)


def test_same_room_twice_rejects_only_the_second(pair: tuple[Any, Any], make_side: Any) -> None:
    prefill, decode = pair
    other_decode = make_side("decode")
    room = open_room(prefill, decode, 20)
    other_decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 20)
    wait_for(lambda: other_decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "second receiver rejected")
    assert "in use" in other_decode.call("failure", room)
    for num_pages, is_last in chunk_plan(20, 20):
        prefill.call("send", room, num_pages, is_last)
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode, other_decode)
    # the room is free again once done
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 20)
    prefill.call("open_sender", room, 20)
    wait_for(lambda: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S, "reuse handshake")
    prefill.call("send", room, 2, True)
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode)


def test_sender_that_never_sends_hits_the_waiting_timeout(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    room = open_room(prefill, decode, 40)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "waiting timeout at decode")
    assert "waiting timeout" in decode.call("failure", room)
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "cancel reaches prefill")
    assert "cancelled by decode" in prefill.call("failure", room)
    assert_pages_back(prefill, decode)
    assert decode.call("metrics")["timed_out_rooms_total"] >= 1
    transfer(prefill, decode, 33)          # both keep serving


def test_a_room_queued_behind_its_prefills_other_rooms_outlives_the_waiting_timeout(
        pair: tuple[Any, Any]) -> None:
    """The waiting timeout is 2 s here. One room gets nothing for 5 s while the same prefill streams another
    room of this decode page by page: the first room keeps waiting (its prefill is alive and working through
    its queue), then gets its KV and succeeds."""
    prefill, decode = pair
    queued_room_outlives_a_busy_room(prefill, decode, decode)


def queued_room_outlives_a_busy_room(prefill: Any, decode: Any, busy_decode: Any) -> None:
    """A room of ``decode`` waits 5.4 s (waiting timeout: 2 s) while ``prefill`` streams a room of
    ``busy_decode`` chunk by chunk; it must still be waiting at every chunk, then get its KV and succeed."""
    queued = open_room(prefill, decode, 40)
    busy = open_room(prefill, busy_decode, 12 * PAGE_SIZE)
    for num_pages, is_last in chunk_plan(12 * PAGE_SIZE, PAGE_SIZE):   # 12 chunks, one every 0.45 s
        prefill.call("send", busy, num_pages, is_last)
        time.sleep(0.45)
        assert decode.call("poll", queued) == KVPoll.WaitingForInput, decode.call("failure", queued)
    finish(prefill, busy_decode, busy)
    for num_pages, is_last in chunk_plan(40, 40):
        prefill.call("send", queued, num_pages, is_last)
    finish(prefill, decode, queued)
    assert_pages_back(prefill, decode, busy_decode)


def test_a_room_queued_behind_another_decodes_rooms_outlives_the_waiting_timeout(
        pair: tuple[Any, Any], make_side: Any) -> None:
    """As above, but the busy room belongs to another decode instance, so this decode sees none of its chunks:
    the prefill's ``queued`` notifications keep the waiting room alive (2 s timeout, 5.4 s of waiting)."""
    prefill, decode = pair
    queued_room_outlives_a_busy_room(prefill, decode, make_side("decode"))


def test_a_room_at_a_prefill_that_posts_nothing_still_hits_the_waiting_timeout(pair: tuple[Any, Any]) -> None:
    """No chunk from that prefill for any room: no ``queued`` notification either, and the room fails."""
    prefill, decode = pair
    room = open_room(prefill, decode, 40)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "waiting timeout at decode")
    assert "waiting timeout" in decode.call("failure", room)
    prefill.call("abort", room, "test over")
    assert_pages_back(prefill, decode)


def test_decode_that_never_shows_up_hits_the_bootstrap_timeout(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    room = next(_rooms)
    prefill.call("open_sender", room, 40)
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "bootstrap timeout at prefill")
    assert "bootstrap timeout" in prefill.call("failure", room)
    assert_pages_back(prefill, decode)
    assert prefill.call("metrics")["timed_out_rooms_total"] >= 1
    transfer(prefill, decode, 17)


def test_abort_from_either_side_ends_the_room_on_both(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    room = open_room(prefill, decode, 80)
    prefill.call("send", room, 2, False)
    prefill.call("abort", room, "client went away")
    wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "prefill abort reaches decode")
    assert "client went away" in decode.call("failure", room)
    room = open_room(prefill, decode, 80)
    prefill.call("send", room, 2, False)
    decode.call("abort", room, "stop")
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "decode abort reaches prefill")
    assert_pages_back(prefill, decode)


def test_incompatible_layout_fails_before_any_byte_moves(pair: tuple[Any, Any], make_side: Any) -> None:
    from kv_harness import smollm2_layout
    prefill, _ = pair
    odd = make_side("decode", layout=smollm2_layout(head_dim=32))
    room = next(_rooms)
    odd.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 20)
    wait_for(lambda: odd.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "compatibility failure")
    failure = odd.call("failure", room)
    assert "head_dim" in failure and "here: " in failure and "peer: " in failure   # both layouts named
    assert "head_dim=32" in failure and "head_dim=64" in failure
    assert_pages_back(odd, prefill)


def test_receiver_killed_mid_transfer(pair: tuple[Any, Any], make_side: Any) -> None:
    prefill, _ = pair
    decode = make_side("decode")
    room = open_room(prefill, decode, 64)
    prefill.call("send", room, 2, False)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Transferring, TIMEOUT_S, "first chunk at decode")
    decode.kill()
    prefill.call("send", room, 2, True)
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Failed, TIMEOUT_S,
             "prefill notices the dead decode")
    assert_pages_back(prefill)
    restarted = make_side("decode", instance_id=decode.instance_id)   # same instance id, new agent
    transfer(prefill, restarted, 50, 20)


def test_stopped_receiver_is_detected_not_waited_on(pair: tuple[Any, Any], make_side: Any) -> None:
    """A decode process stopped (SIGSTOP) mid-transfer: the prefill room ends within a bound instead of
    waiting forever (Mooncake: the WRITE fails after ``MC_TRANSFER_TIMEOUT``, 3 s here; NIXL: UCX copies into
    the stopped process's memory and the room may succeed), and prefill's pages come back while decode is
    still stopped. Decode stays stopped until its rendezvous stayed silent past ``peer_lost_s`` (prefill
    forgets it) and its WRITE ended; once it continues it answers again with the same agent, and its room
    still ends with every page back (prefill handshakes again to answer its cancel), and both sides serve
    again."""
    if make_side.backend == "inprocess":
        pytest.skip("needs a peer in its own OS process")
    prefill, _ = pair
    decode = make_side("decode")
    room = open_room(prefill, decode, 64)
    prefill.call("send", room, 2, False)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Transferring, TIMEOUT_S, "first chunk at decode")
    os.kill(decode.process.pid, signal.SIGSTOP)
    try:
        prefill.call("send", room, 2, True)
        wait_for(lambda: prefill.call("poll", room) in (KVPoll.Success, KVPoll.Failed), STOPPED_BOUND_S,
                 "prefill room ends although decode is stopped")
        if make_side.backend == "mooncake":
            assert prefill.call("poll", room) == KVPoll.Failed
        time.sleep(1.5)   # past the harness's peer_lost_s (1 s): prefill declares the silent decode lost
        wait_for(functools.partial(_pages_back, prefill), STOPPED_BOUND_S,
                 "prefill pages back while decode is still stopped (no WRITE reads them any more)")
    finally:
        os.kill(decode.process.pid, signal.SIGCONT)
    wait_for(lambda: decode.call("poll", room) in (KVPoll.Success, KVPoll.Failed), TIMEOUT_S,
             "decode room ends once the process continues")
    assert_pages_back(prefill, decode)
    transfer(prefill, decode, 50, 20)


def test_prefill_restarted_on_the_same_address(pair: tuple[Any, Any], make_side: Any) -> None:
    _, decode = pair
    prefill = make_side("prefill")
    transfer(prefill, decode, 30)
    room = next(_rooms)
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 30)
    wait_for(lambda: decode.call("poll", room) == KVPoll.WaitingForInput, TIMEOUT_S, "destination published")
    prefill.kill()
    restarted = make_side("prefill", instance_id=prefill.instance_id)   # same instance id, new agent
    new_room = open_room(restarted, decode, 45)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "decode notices the lost prefill")
    assert "prefill instance" in decode.call("failure", room)
    for num_pages, is_last in chunk_plan(45, 16):
        restarted.call("send", new_room, num_pages, is_last)
    finish(restarted, decode, new_room)
    assert_pages_back(decode, restarted)


def test_split_aux_write_path_moves_every_byte_in_process(make_side: Any, pair: tuple[Any, Any]) -> None:
    """The split aux path (taken when the KV is not in host memory: the aux slot, in host memory, is written
    after the KV WRITE completes) moves every byte and the aux data, as the one-WRITE path does. In process
    only, where ``mem_type="VRAM"`` is a flag over host memory: real device memory is not exercised here (NIXL
    VRAM registration needs CUDA)."""
    if make_side.backend != "inprocess":
        pytest.skip("NIXL VRAM registration needs CUDA")
    _, decode = pair
    prefill = make_side("prefill", mem_type="VRAM")
    transfer(prefill, decode, 40, 16)


def test_a_non_final_chunk_lands_while_the_caller_computes(pair: tuple[Any, Any]) -> None:
    """Chunked prefill overlaps the transfer with compute: after ``send`` of a non-final chunk returns, that
    chunk's KV reaches decode's pages while prefill's caller thread makes no further KV call (it is computing
    the next chunk), i.e. before the last chunk is computed and sent."""
    prefill, decode = pair
    room = open_room(prefill, decode, 100)
    plan = chunk_plan(100, 48)    # 3 whole pages, 3 more, then the partly filled last page
    prefill.call("send", room, plan[0][0], False)
    wait_for(lambda: all(decode.call("page_landed", room, i) for i in range(plan[0][0])), TIMEOUT_S,
             "the first chunk's pages at decode before the next send")
    assert not decode.call("page_landed", room, plan[0][0])   # the next chunk's first page: not sent yet
    for num_pages, is_last in plan[1:]:
        prefill.call("send", room, num_pages, is_last)
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode)


def test_aux_data_of_another_room_fails_the_room_at_decode(pair: tuple[Any, Any]) -> None:
    """Decode accepts a room only if its aux slot holds this room's id: a last WRITE whose aux data names
    another room fails the room at decode (every KV byte landed, still Failed), its pages come back on both
    sides, and the next room succeeds."""
    prefill, decode = pair
    room = open_room(prefill, decode, 40)
    prefill.call("send", room, 2, False)
    prefill.call("send", room, 1, True, 7, room + 1)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Failed, TIMEOUT_S, "decode rejects the aux data")
    assert "aux" in decode.call("failure", room) and decode.call("aux", room) is None
    assert_pages_back(prefill, decode)
    transfer(prefill, decode, 40, 16)


def test_inline_send_posts_the_last_write_before_returning(pair: tuple[Any, Any]) -> None:
    """``KVArgs.inline_progress`` (the default): with the destination known, ``send(is_last=True)`` itself
    posts the last WRITE (an earlier chunk goes to the manager thread), and the prefill side counts exactly
    the KV bytes it wrote: 2 whole pages and the 8 filled token slots of the last one (40 tokens; aux not
    counted)."""
    prefill, decode = pair
    bytes_before = prefill.call("metrics")["kv_bytes_total"]
    room = open_room(prefill, decode, 40)
    prefill.call("send", room, 2, False)
    assert prefill.call("send", room, 1, True)
    finish(prefill, decode, room)
    page_bytes = 30 * 2 * PAGE_SIZE * 3 * 64 * 4   # SmolLM2 layout, fp32
    assert prefill.call("metrics")["kv_bytes_total"] - bytes_before == 2 * page_bytes + page_bytes // 2
    assert_pages_back(prefill, decode)


def test_manager_thread_only_progress_moves_every_byte(make_side: Any) -> None:
    """``inline_progress=False``: every WRITE and notification goes through the manager threads."""
    prefill = make_side("prefill", inline_progress=False)
    decode = make_side("decode", inline_progress=False)
    transfer(prefill, decode, 100, 24)


def test_decode_poll_sees_success_between_manager_rounds(make_side: Any) -> None:
    """Inline progress on the decode side: ``poll`` reads the arrived notifications itself, so Success shows
    although the decode manager thread sleeps 3 s between rounds once the destination is out."""
    prefill, decode = make_side("prefill"), make_side("decode", active_tick_s=3.0)
    room = open_room(prefill, decode, 40)
    for num_pages, is_last in chunk_plan(40, 16):
        prefill.call("send", room, num_pages, is_last)
    wait_for(lambda: decode.call("poll", room) == KVPoll.Success, 1.0, "Success at decode within 1 s")
    finish(prefill, decode, room)
    assert_pages_back(prefill, decode)
