"""SampleFanIn: n sample streams → one client stream (vLLM layout: one entry per sample), FINAL exactly
once."""

from __future__ import annotations

import pytest
from serving_fakes import RecordingSink

from serving.delta import ResponseChunk
from serving.workers.parallel_sampling import SampleFanIn


def chunk(text: str, reason: str | None = None, total: int = 1, new: int = 1) -> ResponseChunk:
    return ResponseChunk.single(text=text, finish_reason=reason, num_input_tokens=4, num_output_tokens=total,
                                num_new_tokens=new, cumulative_logprob=-0.5 * total)


def test_streaming_sends_each_sample_response_with_the_others_empty() -> None:
    sink = RecordingSink()
    fan = SampleFanIn(sink, 2, stream=True, logprobs=False)
    a, b = fan.sample_sink(0), fan.sample_sink(1)
    a.send(chunk("x"), final=False)
    b.send(chunk("y"), final=False)
    a.send(chunk("z", "length", 2), final=True)
    assert not sink.finals
    b.send(chunk("w", "stop", 2), final=True)
    chunks = [c for c, _ in sink.chunks]
    assert [[s.text for s in c.samples] for c in chunks] == [["x", ""], ["", "y"], ["z", ""], ["", "w"]]
    assert [s.finish_reason for s in chunks[-1].samples] == ["length", "stop"]
    assert [s.num_new_tokens for s in chunks[-1].samples] == [0, 1]
    assert chunks[-1].samples[0].cumulative_logprob == -1.0   # an idle entry keeps its cumulative value
    assert [final for _, final in sink.chunks] == [False, False, False, True]
    assert sink.finals == 1 and chunks[-1].num_input_tokens == 4 and sink.touched_after_final == 0


def test_each_entry_carries_its_own_samples_cached_tokens() -> None:
    sink = RecordingSink()
    fan = SampleFanIn(sink, 2, stream=True, logprobs=False)
    a, b = fan.sample_sink(0), fan.sample_sink(1)
    a.send(ResponseChunk.single(text="x", num_input_tokens=40, num_output_tokens=1, num_new_tokens=1,
                                num_cached_tokens=32), final=False)
    b.send(ResponseChunk.single(text="y", num_input_tokens=40, num_output_tokens=1, num_new_tokens=1,
                                num_cached_tokens=16), final=False)
    a.send(ResponseChunk.single(text="z", finish_reason="length", num_input_tokens=40, num_output_tokens=2,
                                num_new_tokens=1, num_cached_tokens=32), final=True)
    # an entry stays 0 until its sample reported, then keeps that sample's value
    assert [[s.num_cached_tokens for s in c.samples] for c, _ in sink.chunks] == [[32, 0], [32, 16], [32, 16]]
    whole = RecordingSink()
    fan = SampleFanIn(whole, 2, stream=False, logprobs=False)
    for i, cached in ((1, 16), (0, 32)):
        fan.sample_sink(i).send(ResponseChunk.single(text="t", finish_reason="stop", num_input_tokens=40,
                                                     num_output_tokens=1, num_new_tokens=1,
                                                     num_cached_tokens=cached), final=True)
    assert [s.num_cached_tokens for s in whole.chunks[0][0].samples] == [32, 16]


def test_non_streaming_sends_one_response_once_every_sample_ended() -> None:
    sink = RecordingSink()
    fan = SampleFanIn(sink, 3, stream=False, logprobs=True)
    for i in (2, 0, 1):
        fan.sample_sink(i).send(chunk(f"t{i}", "length", 3, 3), final=True)
    assert len(sink.chunks) == 1 and sink.finals == 1 and sink.chunks[0][1]
    assert [s.text for s in sink.chunks[0][0].samples] == ["t0", "t1", "t2"]
    assert all(s.logprobs is None for s in sink.chunks[0][0].samples)   # the samples' own (none sent here)


def test_one_failure_fails_the_request_and_cancels_the_others() -> None:
    sink = RecordingSink()
    fan = SampleFanIn(sink, 2, stream=True, logprobs=False)
    a, b = fan.sample_sink(0), fan.sample_sink(1)
    a.send(chunk("x"), final=False)
    assert not b.is_cancelled()
    a.send_error("boom")
    assert b.is_cancelled()
    b.send(chunk("late"), final=False)   # dropped
    b.close()                            # its worker ends it: nothing more reaches the client
    assert sink.errors == ["boom"] and sink.finals == 1 and len(sink.chunks) == 1
    assert sink.touched_after_final == 0


def test_a_client_cancel_reaches_every_sample_and_ends_the_stream_once() -> None:
    sink = RecordingSink()
    fan = SampleFanIn(sink, 2, stream=True, logprobs=False)
    sink.cancelled = True
    assert all(fan.sample_sink(i).is_cancelled() for i in range(2))
    fan.sample_sink(0).close()
    fan.sample_sink(1).close()
    assert sink.finals == 1 and not sink.chunks and not sink.errors and sink.touched_after_final == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SampleFanIn(RecordingSink(), 0, stream=True, logprobs=False)
    with pytest.raises(IndexError):
        SampleFanIn(RecordingSink(), 2, stream=True, logprobs=False).sample_sink(2)
