"""gRPC streaming load generator (``tritonclient.grpc.aio``): one stream per in-flight request.

Each request is sent alone on its own bidirectional stream with ``stream=true``, ``ignore_eos`` and the
``triton_enable_empty_final_response`` parameter, so the final flag always arrives (even after the last
token). Arrival timestamps are ``time.perf_counter()`` taken in the event loop as each response is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient

from perf.stats import RequestRecord
from perf.workload import Phase, RequestSpec

logger = logging.getLogger(__name__)


#: The optional outputs the benchmark clients ask for (``num_output_tokens``: tokens of each response).
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
#: The least a client counting streamed tokens needs: a response may carry several tokens (a stream that fell
#: behind gets its tokens merged), so it asks for each response's count and nothing else.
COUNT_ONLY = ("return_num_output_tokens",)


def build_inputs(spec: RequestSpec,
                 return_flags: Sequence[str] = RETURN_FLAGS) -> list[grpcclient.InferInput]:
    """The vLLM-backend inputs of one streaming request (``ignore_eos``: exactly ``max_tokens`` tokens)."""
    params = json.dumps({"max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True})
    return stream_inputs(spec.prompt, params, return_flags)


def stream_inputs(prompt: str, sampling_json: str,
                  return_flags: Sequence[str] = RETURN_FLAGS) -> list[grpcclient.InferInput]:
    """The inputs of one streaming request in the vLLM-backend convention: ``text_input``, ``stream=true``,
    ``sampling_parameters`` (a JSON object string), ``exclude_input_in_output=true``, and the ``return_*``
    flags of the outputs the benchmark reads (by default finish reason, prompt tokens, tokens per response;
    each asked output is one more tensor in every response, built by the model and parsed here)."""
    values: list[tuple[str, str, np.ndarray]] = [
        ("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
        ("stream", "BOOL", np.array([True], dtype=bool)),
        ("sampling_parameters", "BYTES", np.array([sampling_json.encode()], dtype=np.object_)),
        ("exclude_input_in_output", "BOOL", np.array([True], dtype=bool)),
        *((name, "BOOL", np.array([True], dtype=bool)) for name in return_flags),
    ]
    inputs = []
    for name, dtype, array in values:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _int_output(result: Any, name: str) -> int | None:
    try:
        array = result.as_numpy(name)
    except Exception:  # noqa: BLE001 - an absent output (empty final response) is not an error
        return None
    return None if array is None or array.size == 0 else int(array.reshape(-1)[0])


#: How long a stream that answered with an error may take to end by itself, seconds (``read_to_end``).
STREAM_END_GRACE_S = 2.0


async def read_to_end(responses: Any, grace_s: float = STREAM_END_GRACE_S) -> None:
    """Read a stream that answered with an error (it came with FINAL) to its end, up to ``grace_s``. Why: a
    gRPC call dropped before its end is cancelled when it is garbage-collected (grpc.aio), and tritonserver
    2.51 keeps the model of a stream cancelled after its FINAL loaded until its exit timeout (docs/healing.md
    section 4): a run that met many errors (a kill window) then saw the router's server take 20 s to stop."""
    async def drain() -> None:
        async for _ in responses:
            pass
    try:
        await asyncio.wait_for(drain(), grace_s)
    except Exception:  # noqa: BLE001 - the error is what the caller reports; a stream that does not end is left
        pass


async def send_request(client: grpcclient.InferenceServerClient, model: str, spec: RequestSpec,
                       timeout_s: float, return_flags: Sequence[str] = RETURN_FLAGS) -> RequestRecord:
    """Send ``spec`` on a new stream and record every response's arrival until the final flag.

    Never raises for a server-side failure: the record carries ``error``. ``timeout_s`` bounds the whole
    request (the stream is cancelled after it). ``return_flags``: the optional outputs asked for
    (``stream_inputs``); without ``num_input_tokens`` the record keeps the spec's prompt length.
    """
    async def one_request() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": build_inputs(spec, return_flags), "request_id": spec.request_id,
               "parameters": {"triton_enable_empty_final_response": True}}

    record = RequestRecord(request_id=spec.request_id, kind=spec.kind,
                           num_prompt_tokens=spec.num_prompt_tokens,
                           sent_s=time.perf_counter())
    responses = client.stream_infer(one_request(), stream_timeout=timeout_s)
    seen_tokens = 0
    ended = False   # the stream ended by itself after an error
    try:
        async for result, error in responses:
            now = time.perf_counter()
            if error is not None:
                record.error = str(error)
                await read_to_end(responses)   # an error comes with FINAL: no cancel after it (read_to_end)
                ended = True
                break
            delta = _int_output(result, "num_output_tokens")   # tokens of this response
            prompt = _int_output(result, "num_input_tokens")
            if prompt:
                record.num_prompt_tokens = prompt
            text = result.as_numpy("text_output")
            if text is not None and text.size > 0:
                record.text += text.reshape(-1)[0].decode()   # n = 1: one entry per response
            new_tokens = delta if delta is not None else int(text is not None and text.size > 0)
            if new_tokens > 0:
                record.token_times_s.append(now)
                seen_tokens += new_tokens
            if result.get_response().parameters["triton_final_response"].bool_param:
                record.done_s = now
                # no break: our half of the stream is closed already (one request), so the server ends the
                # stream right after FINAL; cancelling it here instead races tritonserver 2.51's gRPC
                # frontend, which then (about one time in two) never releases the model and makes the
                # server's shutdown wait out its whole exit timeout (20 s)
    except Exception as exc:  # noqa: BLE001 - grpc errors / timeouts fail this request only
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        if record.done_s is None and not ended:
            responses.cancel()   # a timeout or a broken stream: the server cancels the request
    record.num_output_tokens = seen_tokens
    if record.done_s is None and record.error is None:
        record.error = "stream ended without the final flag"
    return record


async def _run_slot(client: grpcclient.InferenceServerClient, model: str, specs: Sequence[RequestSpec],
                    stop: asyncio.Event, timeout_s: float, out: list[RequestRecord],
                    return_flags: Sequence[str]) -> None:
    for spec in specs:
        if stop.is_set():
            return
        out.append(await send_request(client, model, spec, timeout_s, return_flags))


async def _run_open(client: grpcclient.InferenceServerClient, model: str, spec: RequestSpec, start_s: float,
                    timeout_s: float, out: list[RequestRecord], return_flags: Sequence[str]) -> None:
    assert spec.arrival_s is not None
    await asyncio.sleep(max(0.0, start_s + spec.arrival_s - time.perf_counter()))
    out.append(await send_request(client, model, spec, timeout_s, return_flags))


async def run_phase(url: str, model: str, phase: Phase, timeout_s: float,
                    return_flags: Sequence[str] = RETURN_FLAGS) -> list[RequestRecord]:
    """Run every request of ``phase`` against ``model`` at ``url`` (``host:port`` of gRPC); records in
    completion order. Closed-loop slots stop early when ``phase.stop_closed_loop_after_open`` and every
    open-loop request has ended. ``return_flags``: as ``send_request``."""
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    closed = [r for r in phase.requests if r.arrival_s is None]
    opened = [r for r in phase.requests if r.arrival_s is not None]
    slots = sorted({r.slot for r in closed})
    async with grpcclient.InferenceServerClient(url) as client:
        start_s = time.perf_counter()
        slot_tasks = [asyncio.create_task(_run_slot(client, model, [r for r in closed if r.slot == s], stop,
                                                    timeout_s, records, return_flags)) for s in slots]
        open_tasks = [asyncio.create_task(_run_open(client, model, r, start_s, timeout_s, records,
                                                    return_flags))
                      for r in opened]
        if open_tasks:
            await asyncio.gather(*open_tasks)
            if phase.stop_closed_loop_after_open:
                stop.set()
        await asyncio.gather(*slot_tasks)
    return records


def run_phase_sync(url: str, model: str, phase: Phase, timeout_s: float,
                   return_flags: Sequence[str] = RETURN_FLAGS) -> list[RequestRecord]:
    """``run_phase`` in a fresh event loop."""
    return asyncio.run(run_phase(url, model, phase, timeout_s, return_flags))
