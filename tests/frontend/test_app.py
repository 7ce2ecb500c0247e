"""The front's HTTP behaviour over a scripted backend, no network: the official openai SDK (unchanged) reads
its bodies and streams; errors before the first token are HTTP errors with OpenAI's body, after it an SSE
error event; a client that disconnects cancels the backend stream, streaming or not."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi.testclient import TestClient
from frontend_fakes import FakeBackend, Script, text_responses
from starlette.requests import Request

from frontend.app import ClientDisconnected, create_app, until_disconnected
from frontend.chat import ChatRenderer
from frontend.config import FrontendConfig
from frontend.wire import BackendResponse, SampleDelta

CONFIG = FrontendConfig(model="pd_ensemble", served_model_name="smol", default_max_tokens=64)


class EchoTemplate:
    """A chat template that shows its messages (the real one is tested live and in test_chat_template)."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + (
            "|assistant:" if add_generation_prompt else "")


def client_for(backend: FakeBackend) -> TestClient:
    return TestClient(create_app(CONFIG, backend, ChatRenderer(EchoTemplate())))


def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_sdk_streams_a_chat_with_usage_last_and_the_rendered_prompt_is_sent() -> None:
    backend = FakeBackend(Script(text_responses(["Hel", "lo"], prompt_tokens=9, reason="stop")))
    with client_for(backend) as http:
        chunks = list(sdk(http).chat.completions.create(
            model="smol", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            stream=True, stream_options={"include_usage": True}, temperature=0, max_completion_tokens=5))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (9, 2)
    sent = backend.sent[0]
    assert sent.prompt == "system:s|user:u|assistant:" and sent.sampling == {
        "max_tokens": 5, "temperature": 0.0}
    assert backend.completed == [sent.request_id] and not backend.cancelled


def test_sdk_reads_a_whole_completion() -> None:
    backend = FakeBackend(Script(text_responses([" Paris", "."], prompt_tokens=5)))
    with client_for(backend) as http:
        body = sdk(http).completions.create(model="smol", prompt="The capital of France is", max_tokens=2)
    assert body.object == "text_completion" and body.choices[0].text == " Paris." and body.model == "smol"
    assert body.choices[0].finish_reason == "length"
    assert body.usage is not None and body.usage.total_tokens == 7
    assert backend.sent[0].prompt == "The capital of France is"


def test_sdk_reads_cached_tokens_in_usage_whole_and_streamed() -> None:
    def cached() -> FakeBackend:
        return FakeBackend(Script(text_responses(["A", "B"], prompt_tokens=40, cached_tokens=32)))

    with client_for(cached()) as http:
        body = sdk(http).completions.create(model="smol", prompt="p", max_tokens=2)
    assert body.usage is not None and body.usage.prompt_tokens_details is not None
    assert body.usage.prompt_tokens == 40 and body.usage.prompt_tokens_details.cached_tokens == 32
    with client_for(cached()) as http:
        chunks = list(sdk(http).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "u"}], stream=True,
            stream_options={"include_usage": True}, max_completion_tokens=2))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 32
    with client_for(FakeBackend(Script(text_responses(["A"])))) as http:   # a server that does not say
        raw = http.post("/v1/completions", json={"model": "smol", "prompt": "p", "max_tokens": 1}).json()
    assert raw["usage"]["prompt_tokens_details"] is None


def test_n_choices_stream_by_index() -> None:
    responses = [BackendResponse((SampleDelta(0, "a", None, 1), SampleDelta(1, "b", None, 1)), 3),
                 BackendResponse((SampleDelta(0, "", "stop", 0), SampleDelta(1, "c", "length", 1)), 3, True)]
    with client_for(FakeBackend(Script(responses))) as http:
        chunks = list(sdk(http).completions.create(model="smol", prompt="p", n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "a", 1: "bc"}


def test_an_error_before_the_first_token_is_an_http_error_with_openais_body() -> None:
    backend = FakeBackend(Script(error="invalid input 'sampling_parameters.max_tokens': must be >= 1, got 0"))
    with client_for(backend) as http:
        for stream in (False, True):
            resp = http.post("/v1/chat/completions",
                             json={"model": "smol", "messages": [{"role": "user", "content": "x"}],
                                   "stream": stream})
            assert resp.status_code == 400
            assert resp.json()["error"] == {"message": "invalid input 'max_tokens': must be >= 1, got 0",
                                            "type": "invalid_request_error", "param": "max_tokens",
                                            "code": None}
        with pytest.raises(openai.BadRequestError):
            sdk(http).completions.create(model="smol", prompt="p")


@pytest.mark.parametrize(("error", "status", "sdk_error"), [
    ("server busy: retry later", 429, openai.RateLimitError),
    ("no healthy decode instance in the fleet", 503, openai.InternalServerError)])
def test_overload_and_an_empty_fleet_have_their_statuses(error: str, status: int,
                                                        sdk_error: type[Exception]) -> None:
    with client_for(FakeBackend(Script(error=error))) as http:
        assert http.post("/v1/completions", json={"model": "smol", "prompt": "p"}).status_code == status
        with pytest.raises(sdk_error):
            sdk(http).completions.create(model="smol", prompt="p")


def test_an_error_after_the_first_token_is_an_sse_error_event_then_done() -> None:
    backend = FakeBackend(Script(text_responses(["a", "b"])[:1], error="decode died"))
    with client_for(backend) as http:
        lines = [line for line in http.post("/v1/completions",
                                            json={"model": "smol", "prompt": "p", "stream": True})
                 .text.splitlines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(lines[-2][6:])["error"]["type"] == "internal_error" and lines[-1] == "data: [DONE]"


def test_bad_bodies_are_400_naming_the_field_and_unknown_models_404() -> None:
    with client_for(FakeBackend()) as http:
        unknown = http.post("/v1/completions", json={"model": "smol", "prompt": "p", "beam_width": 2})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "beam_width"
        assert "Unrecognized request argument" in unknown.json()["error"]["message"]
        bad = http.post("/v1/chat/completions",
                        json={"model": "smol", "messages": [{"role": "robot", "content": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"
        assert http.post("/v1/completions",
                         json={"model": "smol", "prompt": "p", "temperature": 3}).json()["error"][
            "param"] == "temperature"
        missing = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "p"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            sdk(http).completions.create(model="gpt-4", prompt="p")


def test_models_health_and_shutdown_closes_the_backend() -> None:
    backend = FakeBackend()
    with client_for(backend) as http:
        assert [m.id for m in sdk(http).models.list()] == ["smol"]
        assert http.get("/health").status_code == 200
        backend.is_ready = False
        assert http.get("/health").status_code == 503
        assert not backend.closed
    assert backend.closed   # the app's shutdown closed the backend's connection


def _request_that_disconnects_after(delay_s: float) -> Request:
    async def receive() -> dict[str, object]:
        await asyncio.sleep(delay_s)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_a_client_that_disconnects_before_the_answer_cancels_the_backend_stream() -> None:
    from frontend.app import collect, generate
    from frontend.wire import BackendRequest

    async def run() -> FakeBackend:
        backend = FakeBackend(Script(text_responses(["a"] * 50), delay_s=0.05))
        stream = generate(backend, BackendRequest("r1", "p", {}), "prompt")
        with pytest.raises(ClientDisconnected):
            await until_disconnected(_request_that_disconnects_after(0.2), collect(stream, 1))
        return backend

    backend = asyncio.run(run())
    assert backend.cancelled == ["r1"] and not backend.completed


def test_a_streaming_client_that_disconnects_cancels_the_backend_stream() -> None:
    from frontend.app import events, generate
    from frontend.wire import BackendRequest

    async def run() -> FakeBackend:
        backend = FakeBackend(Script(text_responses(["a"] * 50), delay_s=0.02))
        stream = generate(backend, BackendRequest("r2", "p", {}), "prompt")
        first = await anext(stream)
        body = events(first, stream, 1, None, lambda r: None, None)
        reader = asyncio.ensure_future(anext(body, None))  # what Starlette's response task does
        await asyncio.sleep(0.1)
        reader.cancel()                                     # what Starlette does on http.disconnect
        with pytest.raises(asyncio.CancelledError):
            await reader
        return backend

    backend = asyncio.run(run())
    assert backend.cancelled == ["r2"] and not backend.completed
