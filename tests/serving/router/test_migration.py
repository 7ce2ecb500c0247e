"""PDOrchestrator migration: a child failure after the first token reached the client moves the request to a
direct decode elsewhere that resumes from the token ids sent; the client sees every token once, one FINAL,
consistent counts and logprobs; the limit and a cancel end it cleanly. Over a scripted launcher."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
from router_fakes import ScriptedLauncher, fleet_of, status, unavailable
from test_orchestrator import run

from engine.outputs import TokenLogprob
from serving.delta import Delta
from serving.router.config import RouterConfig

FLEET = (status("p0@h:1", "prefill"), status("d0@h:1", "decode"), status("d1@h:1", "decode"),
         status("d2@h:1", "decode"))


def tok(text: str, n: int, ids: tuple[int, ...], cum: float, final: bool = False,
        finish_reason: str | None = None) -> Delta:
    """A child response of ``ids`` (logprob -0.5 each) with ``n`` tokens so far."""
    return Delta(text=text, num_input_tokens=7, num_output_tokens=n, final=final, finish_reason=finish_reason,
                         cumulative_logprob=cum, token_ids=ids,
                         logprobs=tuple(TokenLogprob(t, -0.5, 1, text, ()) for t in ids))


PREFILL = [(0.0, tok("A", 1, (10,), -0.5)), (0.0, Delta(final=True))]
DIES_AFTER_3 = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)),
                (0.0, unavailable("d down"))]
# a resumed child counts the resumed tokens in num_output_tokens and as 0.0 in cumulative_logprob
RESUMED_AFTER_3 = [(0.0, tok("D", 4, (13,), -0.5)), (0.0, tok("E", 5, (14,), -1.0, True, "length"))]


def logprob_ids(out) -> list[int]:
    return [lp.token_id for c in out for lp in (c.logprobs or ())]


def test_a_decode_that_dies_after_three_tokens_is_resumed_elsewhere_and_the_client_sees_each_token_once() -> None:  # noqa: E501 - the name states the invariant
    launcher = ScriptedLauncher({"prefill": PREFILL},
                                by_instance={"d0@h:1": DIES_AFTER_3, "d1@h:1": DIES_AFTER_3,
                                             "d2@h:1": DIES_AFTER_3},
                                resumed=[RESUMED_AFTER_3])
    out, _ = run(launcher, fleet=fleet_of(*FLEET))
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"
    assert out[-1].finish_reason == "length" and out[-1].num_output_tokens == 5
    assert abs(out[-1].cumulative_logprob - -2.5) < 1e-9
    assert logprob_ids(out) == [10, 11, 12, 13, 14]
    decodes = [c for c in launcher.calls if c.role == "decode"]
    assert len(decodes) == 2 and decodes[1].resume_token_ids == (10, 11, 12)
    assert decodes[1].prefill_instance == ""
    assert decodes[1].target.instance_id != decodes[0].target.instance_id
    assert decodes[1].room != decodes[0].room


def test_a_decode_that_dies_while_waiting_for_kv_migrates_with_the_first_token_and_the_prefill_is_cancelled() -> None:  # noqa: E501 - the name states the invariant
    launcher = ScriptedLauncher({"prefill": [(0.0, tok("A", 1, (10,), -0.5)), (5.0, Delta(final=True))],
                                 "decode": [(0.05, unavailable("d down"))]},
                                resumed=[[(0.0, tok("B", 2, (11,), -0.5)),
                                          (0.0, tok("C", 3, (12,), -1.0, True, "stop"))]])
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet_of(*FLEET), max_retries=0)
    assert time.monotonic() - start < 3.0 and out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.resume_token_ids for c in launcher.calls if c.role == "decode"] == [(), (10,)]
    # the prefill was still sending KV to the dead decode (the fake counts the broken decode stream too)
    assert sorted(c.role for c in launcher.cancelled) == ["decode", "prefill"]
    assert all(not c.resume_token_ids for c in launcher.cancelled)
    assert logprob_ids(out) == [10, 11, 12] and abs(out[-1].cumulative_logprob - -1.5) < 1e-9


def test_a_decode_error_that_is_not_about_the_request_migrates_too() -> None:
    dies = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)),
            (0.0, Delta(error="decode engine step failed", final=True))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": dies}, resumed=[RESUMED_AFTER_3])
    out, _ = run(launcher, fleet=fleet_of(*FLEET))
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"


def test_when_the_resumed_decode_dies_too_the_next_migration_resumes_from_everything_sent() -> None:
    again = [(0.0, tok("D", 4, (13,), -0.5)), (0.0, unavailable("d down again"))]
    last = [(0.0, tok("E", 5, (14,), -0.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": DIES_AFTER_3}, resumed=[again, last])
    out, _ = run(launcher, fleet=fleet_of(*FLEET))
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"
    decodes = [c for c in launcher.calls if c.role == "decode"]
    assert [c.resume_token_ids for c in decodes] == [(), (10, 11, 12), (10, 11, 12, 13)]
    assert len({c.target.instance_id for c in decodes}) == 3   # a decode that failed is never picked again
    assert abs(out[-1].cumulative_logprob - -2.5) < 1e-9 and logprob_ids(out) == [10, 11, 12, 13, 14]


def test_the_migration_limit_ends_the_request_with_one_error_and_no_repeated_text() -> None:
    dies = [(0.0, tok("D", 4, (13,), -0.5)), (0.0, unavailable("d down again"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": DIES_AFTER_3}, resumed=[dies])
    out, _ = run(launcher, fleet=fleet_of(*FLEET), migration_limit=1)
    assert "".join(c.text for c in out) == "ABCD" and "migration_limit" in (out[-1].error or "")
    assert len([c for c in launcher.calls if c.role == "decode"]) == 2


def test_with_no_other_decode_the_client_gets_the_error() -> None:
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": DIES_AFTER_3})
    out, _ = run(launcher, fleet=fleet_of(FLEET[0], FLEET[1]))
    assert "".join(c.text for c in out) == "ABC" and "no other decode" in (out[-1].error or "")


def test_a_client_cancel_during_the_migrated_decode_cancels_it() -> None:
    slow = [(5.0, tok("D", 4, (13,), -0.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": DIES_AFTER_3}, resumed=[slow])
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet_of(*FLEET), cancel_after_s=0.3)
    assert time.monotonic() - start < 3.0 and out[-1].finish_reason == "abort"
    assert (10, 11, 12) in [c.resume_token_ids for c in launcher.cancelled]


def test_children_that_send_no_token_ids_are_not_migrated() -> None:
    old = [(0.0, Delta(text="A", num_input_tokens=7, num_output_tokens=1)), (0.0, Delta(final=True))]
    launcher = ScriptedLauncher({"prefill": old, "decode": [(0.02, unavailable("d down"))]})
    out, _ = run(launcher, fleet=fleet_of(*FLEET))
    assert "token ids" in (out[-1].error or "") and len(
        [c for c in launcher.calls if c.role == "decode"]) == 1


def test_a_decode_that_goes_silent_after_the_first_token_is_migrated_after_the_idle_timeout() -> None:
    silent = [(0.0, tok("B", 2, (11,), -1.0)), (30.0, tok("C", 3, (12,), -1.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": silent},
                                resumed=[[(0.0, tok("C", 3, (12,), -0.5, True, "length"))]])
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet_of(*FLEET), request_idle_timeout_s=0.3)
    assert time.monotonic() - start < 5.0 and out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.resume_token_ids for c in launcher.calls if c.role == "decode"] == [(), (10, 11)]


def test_a_decode_that_stops_answering_mid_stream_is_migrated_after_blip_tolerance_s() -> None:
    """A host cut off from the router (no reset: the stream just goes silent) and no longer answering its
    rendezvous: the request moves on after ``blip_tolerance_s``, not after the 300 s idle timeout."""
    start = time.monotonic()
    # d0's last report is the snapshot's; p0 and d1 keep reporting (their reports stay fresh for the test)
    fleet = fleet_of(status("p0@h:1", "prefill", age_s=-1000), status("d0@h:1", "decode"),
                     status("d1@h:1", "decode", age_s=-1000),
                     config=RouterConfig(instance_stale_s=0.3, blip_tolerance_s=0.5),
                     now=lambda: 100.0 + time.monotonic() - start)
    # d0 goes silent, then (its path back) delivers the rest of its backlog and its FINAL
    silent = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)),
              (1.5, tok("X", 4, (99,), -2.0)),
              (0.0, tok("Y", 5, (98,), -2.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL}, by_instance={"d0@h:1": silent},
                                resumed=[RESUMED_AFTER_3])
    out, _ = run(launcher, fleet=fleet, linger_s=2.0, instance_stale_s=0.3, blip_tolerance_s=0.5)
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"   # nothing of d0's backlog
    assert time.monotonic() - start < 5.0
    decodes = [c for c in launcher.calls if c.role == "decode"]
    assert [c.target.instance_id for c in decodes] == ["d0@h:1", "d1@h:1"]
    assert decodes[1].resume_token_ids == (10, 11, 12)
    # d0's stream was left to end by itself, never cancelled (a late cancel aborted tritonserver 2.51)
    assert not [c for c in launcher.cancelled if c.target.instance_id == "d0@h:1"]


def test_a_silent_decode_on_its_own_endpoint_is_migrated_and_its_stream_cancelled() -> None:
    """The same through the workers' own endpoints: the stream given up is cancelled at once (its CANCEL frame
    reaches the worker once the path is back, which then frees its pages even when its KV can no longer come);
    tritonserver's streams are left to end by themselves (the test above)."""
    start = time.monotonic()

    def endpoint(s):
        return replace(s, worker_endpoint=f"127.0.0.1:{9000 + len(s.instance_id)}")

    fleet = fleet_of(endpoint(status("p0@h:1", "prefill", age_s=-1000)), endpoint(status("d0@h:1", "decode")),
                     endpoint(status("d1@h:1", "decode", age_s=-1000)),
                     config=RouterConfig(instance_stale_s=0.3, blip_tolerance_s=0.5),
                     now=lambda: 100.0 + time.monotonic() - start)
    silent = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)),
              (1.5, tok("X", 4, (99,), -2.0)),
              (0.0, tok("Y", 5, (98,), -2.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL}, by_instance={"d0@h:1": silent},
                                resumed=[RESUMED_AFTER_3])
    out, _ = run(launcher, fleet=fleet, linger_s=2.0, instance_stale_s=0.3, blip_tolerance_s=0.5)
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"
    decodes = [c for c in launcher.calls if c.role == "decode"]
    assert [c.target.instance_id for c in decodes] == ["d0@h:1", "d1@h:1"]
    assert decodes[0].target.worker_endpoint
    assert [c.target.instance_id for c in launcher.cancelled] == ["d0@h:1"]


def test_a_decode_silent_for_less_than_blip_tolerance_keeps_its_stream() -> None:
    """A link-down of a few seconds (no reset: the stream and the rendezvous both go silent, the instance
    keeps its last status): past ``instance_stale_s`` but within ``blip_tolerance_s`` the router waits, and
    the stream goes on where it was once the link is back: no migration, no error."""
    start = time.monotonic()
    fleet = fleet_of(status("p0@h:1", "prefill", age_s=-1000), status("d0@h:1", "decode"),
                     status("d1@h:1", "decode", age_s=-1000),
                     config=RouterConfig(instance_stale_s=0.3, blip_tolerance_s=5.0),
                     now=lambda: 100.0 + time.monotonic() - start)
    blip = [(0.02, tok("B", 2, (11,), -1.0)), (1.5, tok("C", 3, (12,), -1.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL}, by_instance={"d0@h:1": blip})
    out, _ = run(launcher, fleet=fleet, instance_stale_s=0.3, blip_tolerance_s=5.0)
    assert out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.target.instance_id for c in launcher.calls if c.role == "decode"] == ["d0@h:1"]


def test_a_decode_known_dead_is_given_up_after_instance_stale_s_not_the_blip_tolerance() -> None:
    """Its rendezvous refused the router (the process ended: the fleet's reading no longer lists it) and its
    stream says nothing: the request moves after ``instance_stale_s``, without waiting
    ``blip_tolerance_s``."""
    from serving.router.fleet import FleetSnapshot

    fleet = fleet_of(*FLEET)
    silent = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)), (30.0, Delta(final=True))]
    launcher = ScriptedLauncher({"prefill": PREFILL}, by_instance={"d0@h:1": silent},
                                resumed=[RESUMED_AFTER_3])
    left = FleetSnapshot((FLEET[0], FLEET[2], FLEET[3]), taken_s=100.0)
    gone = threading.Timer(0.1, lambda: fleet.update(left))
    gone.start()
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet, instance_stale_s=0.3, blip_tolerance_s=30.0)
    gone.join()
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"
    assert time.monotonic() - start < 3.0


def test_a_silent_decode_that_still_answers_its_rendezvous_keeps_its_stream() -> None:
    """Silence alone (a long prefill, decode waiting for KV, a slow step) is no reason to move a request."""
    fleet = fleet_of(status("p0@h:1", "prefill"), status("d0@h:1", "decode"),
                     config=RouterConfig(instance_stale_s=0.3))
    slow = [(0.02, tok("B", 2, (11,), -1.0)), (0.8, tok("C", 3, (12,), -1.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": slow})
    out, _ = run(launcher, fleet=fleet, instance_stale_s=0.3)
    assert out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.role for c in launcher.calls] == ["prefill", "decode"] and launcher.cancelled == []


def drains_at(fleet, delay_s: float, instance_id: str, *remaining) -> threading.Timer:
    """After ``delay_s``, ``fleet`` lists only ``remaining`` and remembers ``instance_id`` (epoch 1) as
    draining: a decode whose server began to stop (it left the member list, its streams run on)."""
    from serving.router.fleet import FleetSnapshot

    timer = threading.Timer(delay_s, lambda: fleet.update(FleetSnapshot(
        tuple(remaining), taken_s=100.0, draining=frozenset({(instance_id, 1)}))))
    timer.start()
    return timer


def test_a_decode_that_drains_mid_stream_hands_the_stream_to_another_decode() -> None:
    """A stopping decode server (its instance draining): the router moves its open stream to another decode,
    which resumes it from the tokens sent, instead of waiting for it; the draining stream is cancelled (the
    worker frees its pages and its drain ends), and the move is no failure of the draining instance."""
    fleet = fleet_of(*FLEET)
    slow = [(0.02, tok("B", 2, (11,), -1.0)), (0.0, tok("C", 3, (12,), -1.5)),
            (5.0, tok("X", 4, (99,), -2.0)), (0.0, tok("Y", 5, (98,), -2.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL}, by_instance={"d0@h:1": slow}, resumed=[RESUMED_AFTER_3])
    timer = drains_at(fleet, 0.2, "d0@h:1", FLEET[0], FLEET[2], FLEET[3])
    start = time.monotonic()
    out, _ = run(launcher, fleet=fleet)
    timer.join()
    assert out[-1].error is None and "".join(c.text for c in out) == "ABCDE"
    assert time.monotonic() - start < 2.0
    decodes = [c for c in launcher.calls if c.role == "decode"]
    assert decodes[0].target.instance_id == "d0@h:1" and decodes[1].resume_token_ids == (10, 11, 12)
    assert decodes[1].target.instance_id != "d0@h:1"
    assert [c.target.instance_id for c in launcher.cancelled] == ["d0@h:1"]
    assert logprob_ids(out) == [10, 11, 12, 13, 14]


def test_a_decode_that_drains_with_no_other_decode_keeps_its_stream_to_the_end() -> None:
    """No decode to move to: the stream runs to its end on the draining decode (its drain waits for it)."""
    fleet = fleet_of(FLEET[0], FLEET[1])
    slow = [(0.02, tok("B", 2, (11,), -1.0)), (0.5, tok("C", 3, (12,), -1.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": slow})
    timer = drains_at(fleet, 0.1, "d0@h:1", FLEET[0])
    out, _ = run(launcher, fleet=fleet)
    timer.join()
    assert out[-1].error is None and "".join(c.text for c in out) == "ABC"
    assert [c.role for c in launcher.calls] == ["prefill", "decode"] and launcher.cancelled == []


def test_each_response_says_how_many_times_its_decode_moved_so_far() -> None:
    """``num_migrations``, the client output of that name: 0 before the first move, then the moves so far, on
    every delta the client gets; the Triton encoder sends it (UINT32 ``[n]``) and the front decodes it into
    the sample's counts."""
    from frontend.wire import Contract, ResponseDecoder
    from serving.delta import ResponseChunk
    from serving.parsing.request import OutputOptions
    from serving.triton.io import response_arrays

    again = [(0.0, tok("D", 4, (13,), -0.5)), (0.0, unavailable("d down again"))]
    last = [(0.0, tok("E", 5, (14,), -0.5, True, "length"))]
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": DIES_AFTER_3}, resumed=[again, last])
    out, _ = run(launcher, fleet=fleet_of(*FLEET))
    assert [(c.text, c.num_migrations) for c in out] == [("A", 0), ("B", 0), ("C", 0), ("D", 1), ("E", 2)]
    arrays = response_arrays(ResponseChunk((out[-1],)), OutputOptions.of("num_migrations"))
    assert arrays["num_migrations"].dtype == np.uint32 and arrays["num_migrations"].tolist() == [2]
    decoded = ResponseDecoder(Contract(frozenset({"return_num_migrations"}))).decode(arrays, final=True)
    assert decoded.samples[0].counts == {"num_migrations": 2}
