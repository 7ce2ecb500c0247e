"""The OpenAI front in front of a real tritonserver with ``pd_ensemble`` (1P1D), through the official
``openai`` SDK, unchanged.

Invariants: a streamed greedy chat equals ``pd_ensemble``'s gRPC text with ``apply_chat_template=true``, and a
completion equals its gRPC text for the same prompt; ``usage`` equals the server's token counts; several turns
with a system message are sent as the model's template renders them; bad requests get OpenAI's error body and
a fitting status; a client that disconnects (streaming or not) gets its KV pages back on both instances.

``n``, logprobs (completions and streamed chat) and penalties reach the server and change what it returns; a
server that answers "unknown parameter" for one of them fails the test (the front and the server both
implement them).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx2 as httpx  # the HTTP client the openai SDK itself uses
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
MAX_TOKENS = 12
QUESTION = "What is the capital of France?"
TURNS: list[Any] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "What is the capital of Italy?"}]


@pytest.fixture(scope="module")
def client(openai_stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_stack.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


def grpc_reference(url: str, prompt: str, params: dict[str, Any], chat: bool = False) -> tuple[str, int, int]:
    """(text, prompt tokens, new tokens) of one streamed request straight to pd_ensemble over gRPC; asks for
    the counts where the model declares ``return_*`` inputs; counts cumulative or per response as declared."""
    client = grpcclient.InferenceServerClient(url)
    declared = {i["name"] for i in client.get_model_config("pd_ensemble", as_json=True)["config"]["input"]}
    flags = {"stream": True, "exclude_input_in_output": True, "apply_chat_template": chat}
    flags.update({f: True for f in ("return_num_input_tokens", "return_num_output_tokens") if f in declared})
    inputs = []
    for name, value in [("text_input", prompt.encode()), ("sampling_parameters", json.dumps(params).encode()),
                        *flags.items()]:
        tensor = grpcclient.InferInput(name, [1], "BOOL" if isinstance(value, bool) else "BYTES")
        tensor.set_data_from_numpy(np.array([value],
                                            dtype=np.bool_ if isinstance(value, bool) else np.object_))
        inputs.append(tensor)
    events: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        events.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("pd_ensemble", inputs, enable_empty_final_response=True)
        assert done.wait(120), "no FINAL from pd_ensemble"
    finally:
        client.stop_stream()
        client.close()
    text, num_in, counts = "", 0, []
    for result, error in events:
        assert error is None, error
        if result.as_numpy("text_output") is None:
            continue
        text += b"".join(result.as_numpy("text_output").reshape(-1)).decode()
        if result.as_numpy("num_input_tokens") is not None:
            num_in = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
        if result.as_numpy("num_output_tokens") is not None:
            counts.append(int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
    num_out = sum(counts) if "return_num_output_tokens" in declared else (counts[-1] if counts else 0)
    return text, num_in, num_out


GREEDY: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0}


def test_streamed_chat_equals_grpc_with_apply_chat_template(openai_stack: Any, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="pd_ensemble",
                                            messages=[{"role": "user", "content": QUESTION}],
                                            stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref_text, ref_in, ref_out = grpc_reference(openai_stack.server.grpc_url, QUESTION, GREEDY, chat=True)
    assert text == ref_text and "Paris" in text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens,
            usage.total_tokens) == (ref_in, ref_out, ref_in + ref_out)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completion_equals_grpc_and_usage_counts_tokens(openai_stack: Any, client: openai.OpenAI,
                                                       tokenizer: Any) -> None:
    prompt = "The capital of France is"
    body = client.completions.create(model="pd_ensemble", prompt=prompt, **GREEDY)
    ref_text, ref_in, ref_out = grpc_reference(openai_stack.server.grpc_url, prompt, GREEDY)
    assert body.choices[0].text == ref_text
    assert body.usage is not None and body.usage.prompt_tokens == ref_in == len(tokenizer.encode(prompt))
    assert body.usage.completion_tokens == ref_out
    assert body.choices[0].finish_reason == ("length" if ref_out == MAX_TOKENS else "stop")


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    whole = client.completions.create(model="pd_ensemble", prompt=prompt, **GREEDY).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="pd_ensemble", prompt=prompt, stream=True, **GREEDY) if c.choices)
    assert streamed == whole and whole


def test_system_message_and_turns_are_the_models_template(openai_stack: Any, client: openai.OpenAI,
                                                          tokenizer: Any) -> None:
    body = client.chat.completions.create(model="pd_ensemble", messages=TURNS, **GREEDY)
    rendered = tokenizer.apply_chat_template(TURNS)
    ref_text, ref_in, _ = grpc_reference(openai_stack.server.grpc_url, rendered, GREEDY)
    assert body.choices[0].message.content == ref_text and body.choices[0].message.role == "assistant"
    assert body.usage is not None and body.usage.prompt_tokens == ref_in == len(tokenizer.encode(rendered))


def test_stop_and_seed(client: openai.OpenAI) -> None:
    stopped = client.completions.create(model="pd_ensemble", prompt="Count: 1, 2, 3,", max_tokens=16,
                                        temperature=0,
                                        stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model="pd_ensemble", prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_bad_requests_get_openais_error_body(openai_stack: Any, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as server_side:   # the server rejects it; the front maps it
        client.completions.create(model="pd_ensemble", prompt="x", max_tokens=4, extra_body={"top_k": -5})
    assert server_side.value.status_code == 400 and server_side.value.param == "top_k"   # type: ignore[attr-defined]
    body: Any = server_side.value.body
    assert body["message"].startswith("invalid input 'top_k': must be >= -1")   # as the client named it
    for nonsense, param in [({"sampling_parameters": {"max_tokens": 4}}, "sampling_parameters"),
                            ({"sampling_parameters": '{"max_tokens": 4}'}, "sampling_parameters"),
                            ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": -1}, "seed"),
                            ({"logit_bias": {"999999": 5}}, None), ({"whitespace": "pretty"}, "whitespace")]:
        request = {"model": "pd_ensemble", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        resp = requests.post(f"{openai_stack.openai_url}/chat/completions", json={**request, **nonsense},
                             timeout=60)
        error = resp.json()["error"]
        assert (resp.status_code, error["param"]) == (400, param), (nonsense, error)
        assert "sampling_parameters" not in error["message"] or param == "sampling_parameters", error
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model="pd_ensemble", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "retrieval"}])  # type: ignore[list-item]
    assert unsupported.value.body["param"] == "tools[0].type"  # type: ignore[index]
    resp = requests.post(f"{openai_stack.openai_url}/chat/completions", timeout=30,
                         json={"model": "pd_ensemble", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 0})
    assert resp.status_code == 400 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_models_and_health(openai_stack: Any, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["pd_ensemble"]
    health = requests.get(openai_stack.openai_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.json() == {"status": "ok"}


def _pages(server: Any, name: str) -> tuple[float, ...]:
    text = requests.get(server.metrics_url, timeout=5).text
    return tuple(float(v) for m in ("prefill", "decode")
                 for v in re.findall(rf'^{name}\{{[^}}]*model="{m}"[^}}]*\}} (\S+)$', text, re.MULTILINE))


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


LONG: dict[str, Any] = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_disconnect_mid_stream_gives_the_pages_back(openai_stack: Any, client: openai.OpenAI) -> None:
    server = openai_stack.server
    total = _pages(server, "pd_kv_total_pages")
    assert _wait_until(lambda: _pages(server, "pd_kv_free_pages") == total)
    stream = client.chat.completions.create(model="pd_ensemble",
                                            messages=[{"role": "user", "content": "Tell a story"}],
                                            stream=True, **LONG)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert _pages(server, "pd_kv_free_pages")[1] < total[1]    # decode holds the request's pages now
    stream.close()
    assert _wait_until(lambda: _pages(server,
                                      "pd_kv_free_pages") == total), _pages(server, "pd_kv_free_pages")


def test_a_non_streaming_client_that_leaves_gives_the_pages_back(openai_stack: Any) -> None:
    server = openai_stack.server
    total = _pages(server, "pd_kv_total_pages")
    assert _wait_until(lambda: _pages(server, "pd_kv_free_pages") == total)
    body = {"model": "pd_ensemble", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):   # the client gives up after 1.5 s and closes its connection
        httpx.post(f"{openai_stack.openai_url}/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    assert _wait_until(lambda: _pages(server,
                                      "pd_kv_free_pages") == total), _pages(server, "pd_kv_free_pages")


# ---- n, logprobs, penalties: the front forwards them and the server applies them ---------------------------

def test_n_choices_by_index(client: openai.OpenAI) -> None:
    body = client.completions.create(model="pd_ensemble", prompt="The capital of France is", n=2, **GREEDY)
    single = client.completions.create(model="pd_ensemble", prompt="The capital of France is", **GREEDY)
    assert sorted(c.index for c in body.choices) == [0, 1]
    assert all(c.text == single.choices[0].text for c in body.choices)   # greedy: both samples alike
    assert body.usage.completion_tokens == 2 * single.usage.completion_tokens
    assert body.usage.prompt_tokens == single.usage.prompt_tokens


def test_completion_logprobs(client: openai.OpenAI) -> None:
    body = client.completions.create(model="pd_ensemble", prompt="The capital of France is",
                                     logprobs=2, **GREEDY)
    lp = body.choices[0].logprobs
    assert len(lp.tokens) == body.usage.completion_tokens and "".join(lp.tokens) == body.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="pd_ensemble", messages=[{"role": "user", "content": QUESTION}], logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True}, **GREEDY))
    content = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == chunks[-1].usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_penalties_are_applied(client: openai.OpenAI) -> None:
    prompt, params = "Repeat after me: la la la la la la", dict[str, Any](max_tokens=16, temperature=0)
    plain = client.completions.create(model="pd_ensemble", prompt=prompt, **params).choices[0].text
    penalised = client.completions.create(model="pd_ensemble", prompt=prompt, frequency_penalty=2.0,
                                          presence_penalty=2.0, **params).choices[0].text
    assert penalised != plain   # a strong penalty changes a repetitive greedy continuation


PAGE_SIZE = 16   # the prefill model's page_size


def _cached(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int)
    return cached


def test_a_repeated_long_prompt_reports_cached_tokens_in_usage(client: openai.OpenAI) -> None:
    """The prefill engine's prefix cache serves a long prompt sent again: usage.prompt_tokens_details says how
    many prompt tokens it supplied (whole pages, below the prompt), once per request even with n > 1."""
    words = " ".join(f"Shelf {i} holds a green book." for i in range(12))
    prompt = f"Note {uuid.uuid4().hex}: {words}"   # unique: nothing cached it before
    first, again = (client.completions.create(model="pd_ensemble", prompt=prompt, **GREEDY) for _ in range(2))
    assert first.usage is not None and first.usage.prompt_tokens >= 3 * PAGE_SIZE
    assert _cached(first.usage) == 0
    hit = _cached(again.usage)
    assert 0 < hit < first.usage.prompt_tokens and hit % PAGE_SIZE == 0
    two = client.completions.create(model="pd_ensemble", prompt=prompt, n=2, **GREEDY)
    assert _cached(two.usage) == hit, "the prompt's cached tokens count once, like prompt_tokens"
    messages: Any = [{"role": "user", "content": f"Chat {uuid.uuid4().hex}: {words}"}]
    usages = [list(client.chat.completions.create(model="pd_ensemble", messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY))[-1].usage
              for _ in range(2)]
    # the chat template's fixed preamble may already be cached, never the unique message
    assert _cached(usages[0]) % PAGE_SIZE == 0 and _cached(usages[0]) < _cached(usages[1])
    assert usages[1] is not None and 0 < _cached(usages[1]) < usages[1].prompt_tokens
    assert _cached(usages[1]) % PAGE_SIZE == 0


def test_serve_sh_role_frontend_starts_only_the_front_and_stops_on_sigterm(
        openai_stack: Any, tmp_path: Any) -> None:
    import os
    import signal
    import subprocess

    from perf.server import REPO_ROOT, free_ports

    (port,) = free_ports(1)
    env = {**os.environ, "SKIP_SETUP": "1", "ROLE": "frontend", "GRPC_URL": openai_stack.server.grpc_url,
           "OPENAI_PORT": str(port), "OPENAI_SERVED_MODEL_NAME": "smol"}
    with open(tmp_path / "front.log", "wb") as log:
        proc = subprocess.Popen([str(REPO_ROOT / "scripts" / "serve.sh")], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_until(lambda: _healthy(url), 60), (tmp_path / "front.log").read_text()
        front = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in front.models.list()] == ["smol"]
        usage = front.completions.create(model="smol", prompt="Hi", max_tokens=2).usage
        assert usage is not None and usage.completion_tokens >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(30)
    log_text = (tmp_path / "front.log").read_text()
    assert "tritonserver" not in log_text.split("OpenAI front on")[0]   # no server, no bootstrap started
    assert code in (0, 143) and not _healthy(url)


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_concurrent_streams_where_half_leave_early(openai_stack: Any) -> None:
    """Four concurrent chat streams; two clients leave after two chunks: the other two finish with their full
    usage, and every page comes back."""
    from concurrent.futures import ThreadPoolExecutor

    server = openai_stack.server
    total = _pages(server, "pd_kv_total_pages")
    assert _wait_until(lambda: _pages(server, "pd_kv_free_pages") == total)

    def one(leave_early: bool) -> int | None:
        client = openai.OpenAI(base_url=openai_stack.openai_url, api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="pd_ensemble", messages=[{"role": "user", "content": "Tell me about rivers."}], stream=True,
            stream_options={"include_usage": True}, max_tokens=24 if not leave_early else 400, temperature=0,
            extra_body={"ignore_eos": True})
        usage = None
        for i, chunk in enumerate(stream):
            if leave_early and i == 2:
                stream.close()
                return None
            usage = chunk.usage or usage
        return usage.completion_tokens if usage else -1

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, [True, False, True, False]))
    assert results == [None, 24, None, 24]
    assert _wait_until(lambda: _pages(server,
                                      "pd_kv_free_pages") == total), _pages(server, "pd_kv_free_pages")


def test_zz_killing_the_front_loses_only_its_own_clients(openai_stack: Any) -> None:
    """``kill -9`` of the OpenAI front mid-stream (run last: the front is gone after it): its client's stream
    breaks, and nothing else does: tritonserver keeps serving ``pd_ensemble`` over gRPC (serve.sh waits on
    tritonserver, not on the front), and every KV page comes back."""
    import os
    import signal
    import subprocess

    server = openai_stack.server
    total = _pages(server, "pd_kv_total_pages")
    port = openai_stack.openai_url.rsplit(":", 1)[1].split("/")[0]
    front = subprocess.run(["pgrep", "-f", "--", f"-m frontend .*--port {port}"],
                           capture_output=True, text=True)
    [front_pid] = [int(pid) for pid in front.stdout.split()]
    client = openai.OpenAI(base_url=openai_stack.openai_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="pd_ensemble", messages=[{"role": "user", "content": "Tell me about rivers."}], stream=True,
        max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(front_pid, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    text, _, _ = grpc_reference(server.grpc_url, "The capital of France is",
                                {"max_tokens": 8, "temperature": 0})
    assert text
    assert _wait_until(lambda: _pages(server,
                                      "pd_kv_free_pages") == total), _pages(server, "pd_kv_free_pages")
