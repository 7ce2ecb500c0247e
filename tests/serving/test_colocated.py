"""``ColocatedWorker`` over a fake engine: responses per the convention, cancellation frees pages and ends the
stream with one FINAL, failures stay with their request."""

from __future__ import annotations

import os
import time

import pytest
from serving_fakes import FakeEngine, FakeFamily, RecordingSink

from serving.delta import ErrorKind
from serving.metrics import LoopMetricsHook, ServingMetrics
from serving.parsing.request import parse_request
from serving.workers.colocated import ColocatedWorker
from serving.workers.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(30)


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        if "\x00" in text:
            raise ValueError("NUL in prompt")
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


@pytest.fixture
def setup():
    FakeFamily.registry.clear()
    engine = FakeEngine(num_pages=200, max_prompt=40, step_s=0.002)
    loop = EngineLoop(engine, name="colo-test", idle_wait_s=0.02)
    metrics = ServingMetrics(FakeFamily, model="colocated", instance="colocated_0")
    loop.add_hook(LoopMetricsHook(loop, metrics, lambda: (engine.num_free_pages, engine.num_total_pages)))
    worker = ColocatedWorker(loop, CharTokenizer(), name="c", metrics=metrics)
    worker.start()
    yield worker, engine
    assert worker.stop(5)


def _req(prompt: str = "hello", **inputs: object):
    return parse_request({"text_input": prompt.encode(), **inputs})  # type: ignore[arg-type]


def test_stream_and_non_stream(setup) -> None:
    worker, _ = setup
    streamed, whole = RecordingSink(), RecordingSink()
    worker.handle(_req(stream=True, sampling_parameters=b'{"max_tokens": 3}'), streamed)
    worker.handle(_req(sampling_parameters=b'{"max_tokens": 2}'), whole)
    assert streamed.done.wait(5) and whole.done.wait(5)
    assert [c.text for c, _ in streamed.chunks] == ["w1 ", "w2 ", "w3 "] and streamed.finals == 1
    assert [c.text for c, _ in whole.chunks] == ["hellow1 w2 "] and whole.finals == 1
    assert whole.chunks[0][0].num_input_tokens == 5
    assert worker.num_active() == 0


def test_chat_template_changes_the_prompt(setup) -> None:
    worker, _ = setup
    sink = RecordingSink()
    worker.handle(_req(apply_chat_template=True, exclude_input_in_output=True,
                       sampling_parameters=b'{"max_tokens": 1}'), sink)
    assert sink.done.wait(5)
    assert sink.chunks[0][0].num_input_tokens == len("<user>hello")


def test_cancel_frees_pages_and_sends_one_bare_final(setup) -> None:
    worker, engine = setup
    sink, other = RecordingSink(), RecordingSink()
    worker.handle(_req(stream=True, sampling_parameters=b'{"max_tokens": 150}'), sink)
    worker.handle(_req(stream=True, sampling_parameters=b'{"max_tokens": 5}'), other)
    deadline = time.monotonic() + 5
    while not sink.chunks and time.monotonic() < deadline:
        time.sleep(0.001)
    sink.cancelled = True
    assert sink.done.wait(5) and other.done.wait(5)
    time.sleep(0.1)
    assert sink.finals == 1 and not sink.errors and sink.touched_after_final == 0
    assert not sink.chunks[-1][1]  # the FINAL was the bare one
    assert other.finals == 1 and other.chunks[-1][0].finish_reason == "length"
    assert engine.num_free_pages == engine.num_total_pages and worker.num_active() == 0
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0", "outcome": "cancelled",
                      "pid": str(os.getpid())}.items()))
    deadline = time.monotonic() + 5   # the metrics' flusher thread sends it within its interval
    while key not in FakeFamily.registry["pd_requests_total"].series and time.monotonic() < deadline:
        time.sleep(0.01)
    assert FakeFamily.registry["pd_requests_total"].series[key].value() == 1


def test_bad_requests_fail_alone(setup) -> None:
    worker, _ = setup
    too_long, bad_tok, good = RecordingSink(), RecordingSink(), RecordingSink()
    worker.handle(_req("x" * 100), too_long)
    worker.handle(_req("a\x00b"), bad_tok)
    worker.handle(_req(sampling_parameters=b'{"max_tokens": 4}'), good)
    for sink in (too_long, bad_tok, good):
        assert sink.done.wait(5) and sink.finals == 1
    assert "rejected" in too_long.errors[0] and "tokenization" in bad_tok.errors[0]
    assert too_long.error_kinds == bad_tok.error_kinds == [ErrorKind.REQUEST]
    assert good.chunks[0][0].text == "hellow1 w2 w3 w4 " and not good.errors


def test_stop_ends_requests_in_flight_with_an_error(setup) -> None:
    worker, _ = setup
    sink = RecordingSink()
    worker.handle(_req(stream=True, sampling_parameters=b'{"max_tokens": 150}'), sink)
    time.sleep(0.05)
    assert worker.stop(5)
    assert sink.finals == 1 and "stopped" in sink.errors[0] and sink.error_kinds == [ErrorKind.INSTANCE]
    late = RecordingSink()
    worker.handle(_req(), late)
    assert late.finals == 1 and late.errors


def test_a_grammar_compiles_at_admission_and_a_refused_one_fails_alone(setup) -> None:
    worker, engine = setup
    long, good, bad = RecordingSink(), RecordingSink(), RecordingSink()
    worker.handle(_req(stream=True, sampling_parameters=b'{"max_tokens": 20}'), long)
    worker.handle(
        _req(sampling_parameters=b'{"max_tokens": 2, "structured_outputs": {"regex": "w.*"}}'), good)
    worker.handle(_req(
        sampling_parameters=b'{"max_tokens": 2, "structured_outputs": {"regex": "reject-me"}}'),
                  bad)
    assert bad.done.wait(5) and good.done.wait(5) and long.done.wait(5)
    assert bad.errors == ["invalid input 'sampling_parameters.structured_outputs.regex': cannot be compiled: "
                          "refused by the fake"] and bad.finals == 1 and not bad.chunks
    assert bad.error_kinds == [ErrorKind.REQUEST]
    assert good.errors == [] and long.errors == [] and long.text.count("w") == 20
    # not the loop thread
    assert engine.prepare_thread_ids and not engine.prepare_thread_ids & engine.thread_ids
