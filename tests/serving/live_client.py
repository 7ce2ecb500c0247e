"""Small tritonclient helpers for the live tests: one gRPC stream per request, so every response (errors
included, which carry no request id) belongs to that request."""

from __future__ import annotations

import json
import queue
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient

RESPONSE_TIMEOUT_S = 120.0


@dataclass
class StreamResult:
    """What one request got back."""

    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)   # cumulative, one per response
    error: str | None = None
    final_seen: bool = False
    first_text_s: float | None = None   # time.monotonic() when the first text arrived
    end_s: float | None = None          # time.monotonic() when the stream ended (FINAL, an error or a cancel)
    #: (token id, logprob) of each sampled token, from the ``logprobs`` output (asked with ``return_logprobs``
    #: and the ``logprobs`` sampling parameter); empty otherwise
    token_logprobs: list[tuple[int, float]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


#: The optional outputs the live tests ask for by default (``StreamResult`` reads them).
COUNT_OUTPUTS = {"return_finish_reason": True, "return_num_input_tokens": True,
                 "return_num_output_tokens": True}


def make_inputs(prompt: str | bytes, params: dict[str, Any] | str | None = None, stream: bool = True,
                **flags: bool) -> list[grpcclient.InferInput]:
    """The LLM-convention inputs; ``params`` as a dict is JSON-encoded, as a str sent as is. ``flags`` are
    BOOL inputs, on top of ``COUNT_OUTPUTS`` (pass ``return_...=False`` to leave one out)."""
    flags = {**COUNT_OUTPUTS, **flags}
    def tensor(name: str, value: Any, dtype: str) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        return t

    raw = prompt.encode() if isinstance(prompt, str) else prompt
    inputs = [tensor("text_input", raw, "BYTES"), tensor("stream", stream, "BOOL")]
    if params is not None:
        text = params if isinstance(params, str) else json.dumps(params)
        inputs.append(tensor("sampling_parameters", text.encode(), "BYTES"))
    inputs += [tensor(name, value, "BOOL") for name, value in flags.items()]
    return inputs


def grpc_generate(url: str, inputs: list[grpcclient.InferInput], model: str = "colocated",
                  cancel_after: int | None = None,
                  on_first_text: Callable[[], None] | None = None) -> StreamResult:
    """Send one request on its own stream; read until FINAL, an error, or ``cancel_after`` responses (then
    cancel: ``stop_stream(cancel_requests=True)``). ``on_first_text`` is called once, on this thread, when the
    first text arrived."""
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    result = StreamResult()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="live", enable_empty_final_response=True)
        while True:
            res, err = events.get(timeout=RESPONSE_TIMEOUT_S)
            if err is not None:
                result.error = str(err)
                result.end_s = time.monotonic()
                return result
            had_text = result.first_text_s is not None
            _record(result, res)
            if on_first_text is not None and not had_text and result.first_text_s is not None:
                on_first_text()
            if result.final_seen:
                result.end_s = time.monotonic()
                return result
            if cancel_after is not None and len(result.texts) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return result
    finally:
        client.stop_stream()
        client.close()


def _record(result: StreamResult, res: Any) -> None:
    params = res.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    text = res.as_numpy("text_output")
    if text is not None:  # an empty final response carries no outputs
        result.texts.append(b"".join(text.reshape(-1)).decode())
        if result.first_text_s is None and result.texts[-1]:
            result.first_text_s = time.monotonic()
        reason = res.as_numpy("finish_reason")
        reason_text = reason.reshape(-1)[0].decode() if reason is not None else ""
        result.finish_reasons.append("" if reason_text == "None" else reason_text)
        new_tokens = res.as_numpy("num_output_tokens")   # tokens of this response (the vLLM convention)
        total = result.num_output_tokens[-1] if result.num_output_tokens else 0
        result.num_output_tokens.append(
            total + (int(new_tokens.reshape(-1)[0]) if new_tokens is not None else 0))
        # per token {"<id>": {"logprob": ...}, ...}, the sampled one first
        logprobs = res.as_numpy("logprobs")
        entries = json.loads(logprobs.reshape(-1)[0]) if logprobs is not None else None
        for entry in entries or []:
            token_id, chosen = next(iter(entry.items()))
            result.token_logprobs.append((int(token_id), float(chosen["logprob"])))
    result.final_seen = final


def http_generate_stream(http_url: str, body: dict[str, Any],
                         model: str = "colocated") -> list[dict[str, Any]]:
    """POST ``/v2/models/<model>/generate_stream``; returns the SSE events once the server closed the
    stream."""
    with requests.post(f"{http_url}/v2/models/{model}/generate_stream", json=body, stream=True,
                       timeout=RESPONSE_TIMEOUT_S) as resp:
        return [json.loads(line[len(b"data: "):]) for line in resp.iter_lines() if line.startswith(b"data: ")]


def metric_value(metrics_url: str, name: str, **labels: str) -> float:
    """The value of one series on the Prometheus endpoint (the first whose labels include ``labels``)."""
    text = requests.get(metrics_url, timeout=5).text
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    raise KeyError(f"{name}{labels} not on {metrics_url}")


def finished_requests(metrics_url: str, model: str) -> float:
    """``pd_requests_total{outcome="finished"}`` of ``model`` on a server's metrics endpoint; 0 before the
    first (the series appears with its first finished request)."""
    try:
        return metric_value(metrics_url, "pd_requests_total", model=model, outcome="finished")
    except KeyError:
        return 0.0


def streams_match_reference(generate: Callable[[str], StreamResult], prompts: Sequence[str],
                            reference: dict[str, str]) -> list[StreamResult]:
    """Run every prompt at once (one thread each) through ``generate``; assert each stream ended with FINAL,
    no error and exactly the reference text. Returns the results, in ``prompts`` order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(generate, prompts))
    for prompt, res in zip(prompts, results):
        assert res.error is None and res.final_seen, res.error
        assert res.text == reference[prompt], prompt[:40]
    return results
