"""ResponseDispatcher: producers only queue; one thread sends in order, polls cancellation, never touches a
sender after FINAL, and drains what is queued on stop. Fake senders, no Triton."""

from __future__ import annotations

import threading
import time

import pytest

from serving.triton.response_dispatch import ResponseDispatcher

FINAL = 1


class FakeSender:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.sent: list[tuple[object, int]] = []
        self.cancelled = False
        self.calls_after_final = 0
        self.block = block

    def send(self, response: object = None, flags: int = 0) -> None:
        if self.block is not None:
            self.block.wait(10)
        if self.sent and self.sent[-1][1] == FINAL:
            self.calls_after_final += 1
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        if self.sent and self.sent[-1][1] == FINAL:
            self.calls_after_final += 1
        return self.cancelled


def started(poll_s: float = 0.01) -> ResponseDispatcher:
    dispatcher = ResponseDispatcher("test", FINAL, cancel_poll_interval_s=poll_s)
    dispatcher.start()
    return dispatcher


def test_responses_go_out_in_order_and_nothing_touches_a_sender_after_final() -> None:
    dispatcher, sender = started(), FakeSender()
    handle = dispatcher.open(sender, "r1")
    for i in range(50):
        dispatcher.submit(handle, lambda i=i: f"chunk{i}", final=False)
    dispatcher.submit(handle, None, final=True)
    dispatcher.submit(handle, lambda: "late", final=False)   # dropped: after FINAL
    time.sleep(0.1)   # several cancel polls after FINAL
    assert dispatcher.stop(5.0)
    assert [r for r, _ in sender.sent] == [f"chunk{i}" for i in range(50)] + [None]
    assert sender.sent[-1][1] == FINAL and sender.calls_after_final == 0


def test_cancellation_is_polled_and_cached_for_the_producer() -> None:
    dispatcher, sender = started(), FakeSender()
    handle = dispatcher.open(sender)
    assert not handle.cancelled
    sender.cancelled = True
    deadline = time.monotonic() + 2.0
    while not handle.cancelled and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle.cancelled
    dispatcher.stop(5.0)


def test_a_stuck_sender_never_blocks_the_producer_and_stop_drains_the_queue() -> None:
    release = threading.Event()
    dispatcher, stuck = started(), FakeSender(block=release)
    handle = dispatcher.open(stuck)
    started_s = time.monotonic()
    for _ in range(100):
        dispatcher.submit(handle, lambda: "x", final=False)
    dispatcher.submit(handle, None, final=True)
    assert time.monotonic() - started_s < 0.5          # queueing is all the producer does
    assert dispatcher.queued > 0
    release.set()
    assert dispatcher.stop(10.0)
    assert len(stuck.sent) == 101 and stuck.sent[-1][1] == FINAL


def test_a_stream_that_fell_behind_gets_its_queued_chunks_merged_in_order_and_others_are_untouched() -> None:
    """While the sender is stuck, one stream queues 20 chunk responses, then FINAL; another stream queues a
    plain response: once the sender moves, the first stream's chunks go out as one response (the texts and
    token counts joined, in order) with the FINAL flag, and the plain response as it was."""
    from serving.delta import ResponseChunk, merge_chunks

    release = threading.Event()
    dispatcher = ResponseDispatcher("test", FINAL, cancel_poll_interval_s=0.01, merge=merge_chunks)
    dispatcher.start()
    blocker, behind, plain = FakeSender(block=release), FakeSender(), FakeSender()
    dispatcher.submit(dispatcher.open(blocker), lambda: "first", final=False)   # the thread waits in here
    handle = dispatcher.open(behind)
    for i in range(20):
        chunk = ResponseChunk.single(text=f"t{i} ", num_input_tokens=3, num_output_tokens=i + 1,
                                     num_new_tokens=1, token_ids=(i,))
        dispatcher.submit_chunk(handle, chunk, lambda c: c, final=i == 19)
    dispatcher.submit(dispatcher.open(plain), lambda: "plain", final=True)
    release.set()
    assert dispatcher.stop(5.0)
    assert len(behind.sent) == 1 and behind.sent[0][1] == FINAL
    merged = behind.sent[0][0]
    assert merged.text == "".join(f"t{i} "
                                  for i in range(20)) and merged.samples[0].token_ids == tuple(range(20))
    assert (merged.num_output_tokens, merged.samples[0].num_new_tokens,
            merged.num_input_tokens) == (20, 20, 3)
    assert plain.sent == [("plain", FINAL)] and dispatcher.merged_total == 19


def test_a_stream_that_keeps_up_gets_one_response_per_chunk() -> None:
    from serving.delta import ResponseChunk, merge_chunks

    dispatcher = ResponseDispatcher("test", FINAL, cancel_poll_interval_s=0.01, merge=merge_chunks)
    dispatcher.start()
    sender = FakeSender()
    handle = dispatcher.open(sender)
    for i in range(5):
        dispatcher.submit_chunk(handle, ResponseChunk.single(text=str(i), num_output_tokens=i + 1,
                                                             num_new_tokens=1),
                                lambda c: c.text, final=i == 4)
        deadline = time.monotonic() + 2.0
        while len(sender.sent) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.002)
    assert dispatcher.stop(5.0)
    assert sender.sent == [("0", 0), ("1", 0), ("2", 0), ("3", 0), ("4", FINAL)]
    assert dispatcher.merged_total == 0


def test_merged_chunks_join_logprobs_and_keep_each_samples_latest_counts() -> None:
    from engine.outputs import TokenLogprob
    from serving.delta import Delta, ResponseChunk, merge_chunks

    lp = (TokenLogprob(5, -0.5, 1, "a"),)
    a = ResponseChunk((Delta(text="a", num_input_tokens=9, num_output_tokens=1, num_new_tokens=1,
                             cumulative_logprob=-0.5, logprobs=lp, num_cached_tokens=4, token_ids=(5,)),
                       Delta(text="", num_input_tokens=9, logprobs=())))
    b = ResponseChunk((Delta(text="b", finish_reason="stop", num_input_tokens=9, num_output_tokens=2,
                             num_new_tokens=1, cumulative_logprob=-1.0, logprobs=lp, num_cached_tokens=4,
                             token_ids=(6,)),
                       Delta(text="x", num_input_tokens=9, num_output_tokens=1, num_new_tokens=1,
                             cumulative_logprob=-0.2, logprobs=lp)))
    m = merge_chunks(a, b)
    assert m.samples[0] == Delta(text="ab", finish_reason="stop", num_input_tokens=9, num_output_tokens=2,
                                 num_new_tokens=2, cumulative_logprob=-1.0, logprobs=lp + lp,
                                 num_cached_tokens=4,
                                 token_ids=(5, 6))
    assert m.samples[1] == Delta(text="x", num_input_tokens=9, num_output_tokens=1, num_new_tokens=1,
                                 cumulative_logprob=-0.2, logprobs=lp, num_cached_tokens=0, token_ids=())
    assert m.num_input_tokens == 9
    with pytest.raises(ValueError):
        merge_chunks(a, ResponseChunk.single(text="z"))


def test_a_merged_prefill_token_and_final_keep_the_tokens_finish_reason() -> None:
    """A prefill's first token with ``max_tokens=1`` says "length"; its final response (sent once the KV is
    written) says nothing. Merged (a stream that fell behind), the finish reason must survive: the router
    otherwise streams the token as an unfinished chunk and ends the request with an empty response."""
    from serving.delta import ResponseChunk, merge_chunks

    token = ResponseChunk.single(text=" Paris", finish_reason="length", num_input_tokens=6,
                                 num_output_tokens=1, num_new_tokens=1, cumulative_logprob=-1.5,
                                 token_ids=(42,))
    final = ResponseChunk.single(num_input_tokens=6, num_output_tokens=1, cumulative_logprob=-1.5)
    merged = merge_chunks(token, final)
    assert merged.finish_reason == "length" and merged.text == " Paris"
    assert merged.samples[0].token_ids == (42,) and merged.samples[0].num_new_tokens == 1
    later = ResponseChunk.single(text="!", finish_reason="stop", num_output_tokens=2, num_new_tokens=1)
    assert merge_chunks(token, later).finish_reason == "stop"   # the later one's, where it has one
