"""``GenerationStream``: the response shapes of the LLM convention, and exactly one FINAL per request."""

from __future__ import annotations

from serving_fakes import RecordingSink

from engine.errors import RequestRejected
from engine.outputs import RequestOutput
from serving.events import RequestAborted, RequestFailed
from serving.parsing.request import parse_request
from serving.stream import GenerationStream


def _outputs(*texts: str) -> list[RequestOutput]:
    n = len(texts)
    return [RequestOutput("r", [i], [0.0], t, i == n - 1, "stop" if i == n - 1 else None, 4, i + 1)
            for i, t in enumerate(texts)]


def _run(stream: bool, texts: tuple[str, ...], **inputs: object) -> RecordingSink:
    sink = RecordingSink()
    req = parse_request({"text_input": b"Hi: ", "stream": stream, **inputs})  # type: ignore[arg-type]
    gs = GenerationStream("r", req, sink)
    ends = [gs.on_event(o) for o in _outputs(*texts)]
    assert ends == [False] * (len(texts) - 1) + [True]
    return sink


def test_streaming_sends_one_response_per_delta_and_final_last() -> None:
    sink = _run(True, ("a", "", "b", "c"))
    assert [(c.text, final) for c, final in sink.chunks] == [("a", False), ("b", False), ("c", True)]
    last = sink.chunks[-1][0]
    assert (last.finish_reason, last.num_input_tokens, last.num_output_tokens) == ("stop", 4, 4)
    assert sink.finals == 1 and sink.chunks[0][0].finish_reason is None


def test_every_response_carries_the_engines_cached_prompt_tokens() -> None:
    sink = RecordingSink()
    gs = GenerationStream("r", parse_request({"text_input": b"Hi", "stream": True}), sink)
    for i, text in enumerate(("a", "b")):
        gs.on_event(RequestOutput("r", [i], [0.0], text, i == 1, "stop" if i == 1 else None, 40, i + 1,
                                  num_cached_tokens=32))
    assert [c.samples[0].num_cached_tokens for c, _ in sink.chunks] == [32, 32]


def test_streaming_final_may_be_empty() -> None:
    sink = _run(True, ("a", ""))
    assert [(c.text, final) for c, final in sink.chunks] == [("a", False), ("", True)]


def test_non_streaming_sends_one_response_with_prompt_prepended() -> None:
    sink = _run(False, ("a", "b", "c"))
    assert len(sink.chunks) == 1 and sink.chunks[0] [1] and sink.chunks[0][0].text == "Hi: abc"


def test_non_streaming_exclude_input() -> None:
    sink = _run(False, ("a", "b"), exclude_input_in_output=True)
    assert [c.text for c, _ in sink.chunks] == ["ab"]


def test_failure_is_one_error_with_final_and_later_events_are_ignored() -> None:
    sink = RecordingSink()
    gs = GenerationStream("r", parse_request({"text_input": b"x", "stream": True}), sink)
    assert gs.on_event(_outputs("a", "b")[0]) is False
    assert gs.on_event(RequestFailed("r", RequestRejected("r", "too long"))) is True
    assert gs.on_event(_outputs("a", "b")[1]) is True
    assert sink.errors == ["request rejected: too long"]   # without the worker's internal request id
    assert sink.finals == 1 and sink.touched_after_final == 0


def test_cancelled_stream_ends_with_bare_final() -> None:
    sink = RecordingSink()
    gs = GenerationStream("r", parse_request({"text_input": b"x", "stream": True}), sink)
    gs.cancelled = True
    assert gs.on_event(RequestFailed("r", RequestAborted("r", "cancelled"))) is True
    assert sink.finals == 1 and not sink.errors and not sink.chunks


def test_token_ids_of_outputs_without_text_go_out_with_the_next_response() -> None:
    sink = _run(True, ("a", "", "", "b", ""))
    assert [c.samples[0].token_ids for c, _ in sink.chunks] == [(0,), (1, 2, 3), (4,)]
