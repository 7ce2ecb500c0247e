"""Child requests of a fleet with a secret are authenticated on both paths into a worker (issue #44, attacks
2 and 3): one tritonserver with ``PD_FLEET_SECRET``, ``pd_ensemble`` (its router reaches the workers at their
own endpoints), ``pd_triton`` (a copy that reaches them through tritonserver), ``prefill`` and ``decode``.

Invariants: a direct decode child request without a signature, sent by a client that reaches decode's
tritonserver gRPC or decode's own endpoint, gets one FINAL error "unauthenticated child request: ..." and no
token, and the worker does no work for it (its request counters do not move); a real signature made for
prefill, put on a request of our own (another prompt, model ``decode``), is refused the same way on both
paths; a signed request is served once, and the same signed request replayed to either path afterwards is
refused (one replay guard per worker); both routers (signing in the ``OPEN`` frame and in the
``pd_fleet_auth`` parameter, after their own signed ``describe`` discovery) keep serving the colocated
engine's greedy text before and after the attacks.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from live_client import grpc_generate, make_inputs
from live_prompts import colocated_greedy_texts
from perf.server import ServeScript, supervised
from test_worker_endpoint_live import make_model_repository

from serving.child.codec import decode_raw_response
from serving.child.signing import AUTH_PARAMETER
from serving.delta import Delta, ErrorKind
from serving.router.fleet import Target
from serving.router.launch import (
    ChildCall,
    FrameConnection,
    child_arrays,
    child_request,
    child_request_id,
    sign_child,
)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
TRITON_MODELS = ("pd_ensemble", "pd_triton", "prefill", "decode")
SECRET = b"live-fleet-secret"
GREEDY = {"max_tokens": "8", "temperature": "0"}
PROMPT = "The capital of France is"
ATTACK_PROMPT = b"What is my bank password? It is hunter2. Repeat it:"
ROUTERS = ("pd_ensemble", "pd_triton")
READY_TIMEOUT_S, STOP_TIMEOUT_S, CLEAN_STOP_S = 180.0, 40.0, 15.0   # as the shared fixture's (conftest)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeScript]:
    """The module's tritonserver, started with the fleet secret (the shared fixture passes none)."""
    pytest.importorskip("pytriton", reason="nvidia-pytriton is not installed: run scripts/setup.sh")
    repository = make_model_repository(tmp_path_factory.mktemp("model_repository"))
    log_path = tmp_path_factory.mktemp("triton") / "server.log"
    env = {"PD_FLEET_SECRET": SECRET.decode()}
    script = ServeScript(",".join(TRITON_MODELS), log_path, repository, env=env)
    with supervised(script, READY_TIMEOUT_S, STOP_TIMEOUT_S, CLEAN_STOP_S):
        yield script


@pytest.fixture(scope="module")
def expected() -> str:
    return colocated_greedy_texts([PROMPT], GREEDY)[PROMPT]


def worker(log_path: Path, role: str) -> tuple[str, str]:
    """(instance id, own endpoint ``host:port``) of the ``role`` worker, from the server's log."""
    log = log_path.read_text(errors="replace")
    instance = re.search(rf"ready as {role} instance ({role}@[0-9.]+:[0-9]+)", log)
    endpoint = re.search(rf"worker endpoint of {role} at ([0-9.]+:[0-9]+)", log)
    assert instance and endpoint, log[-4000:]
    return instance.group(1), endpoint.group(1)


def child_call(role: str, instance: str, address: str, prompt: bytes, room: int, endpoint: bool) -> ChildCall:
    """A direct child request to ``instance`` (a decode that prefills itself: a generation of one's own)."""
    target = Target(instance, role, address, role, worker_endpoint=endpoint)
    return ChildCall(role, target, room, "", "", inputs={"text_input": prompt,
                                                         "sampling_parameters": json.dumps(GREEDY).encode()})


def through_triton(grpc_url: str, call: ChildCall, signature: str, request_id: str = "") -> list[Delta]:
    """``call`` sent as a client would to the worker's tritonserver gRPC (tritonclient streaming: the child
    inputs, ``signature`` in the ``pd_fleet_auth`` parameter when given, ``request_id`` instead of the call's
    own when given); its responses up to FINAL."""
    import tritonclient.grpc as grpcclient

    arrays = child_arrays(call)
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else "BOOL" if array.dtype == np.bool_ else \
            "INT64" if array.dtype == np.int64 else "INT32"
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    deltas: list[Delta] = []
    try:
        client.async_stream_infer(call.target.model_name, inputs, enable_empty_final_response=True,
                                  request_id=request_id or child_request_id(call),
                                  parameters={AUTH_PARAMETER: signature} if signature else None)
        while not (deltas and deltas[-1].final):
            result, error = events.get(timeout=60)
            if error is not None:
                deltas.append(Delta.failure(str(error)))
                break
            response = result.get_response()
            raw = response.raw_output_contents
            deltas.append(decode_raw_response({o.name: raw[i] for i, o in enumerate(response.outputs)},
                                              response.parameters["triton_final_response"].bool_param))
    finally:
        client.stop_stream(cancel_requests=False)
        client.close()
    return deltas


def through_endpoint(call: ChildCall, signature: str, request_id: str = "") -> list[Delta]:
    """``call`` sent to the worker's own endpoint in child frames, ``signature`` in its ``OPEN``
    (``request_id`` instead of the call's own when given); the responses up to FINAL."""
    from tritonclient.grpc import service_pb2

    request = child_request(call)
    request.id = request_id or request.id

    async def run() -> list[Delta]:
        connection = FrameConnection(call.target.endpoint, 5.0)
        await connection.connected()
        _, inbox = connection.open(signature, request.SerializeToString())
        deltas: list[Delta] = []
        while not (deltas and deltas[-1].final):
            payload = await asyncio.wait_for(inbox.get(), 60)
            assert payload is not None, connection.lost
            result = service_pb2.ModelStreamInferResponse.FromString(payload).infer_response
            raw = result.raw_output_contents
            deltas.append(decode_raw_response({o.name: raw[i] for i, o in enumerate(result.outputs)},
                                              result.parameters["triton_final_response"].bool_param))
        await connection.close()
        return deltas

    return asyncio.run(run())


def assert_refused(deltas: list[Delta], reason: str) -> None:
    """One FINAL error naming ``reason``, no text, no token."""
    assert len(deltas) == 1, deltas
    assert deltas[0].final and deltas[0].error_kind is ErrorKind.INSTANCE, deltas
    assert deltas[0].error.startswith("unauthenticated child request: ") and reason in deltas[0].error, deltas
    assert not deltas[0].text and not deltas[0].token_ids and deltas[0].num_output_tokens == 0


def worker_requests(metrics_url: str) -> dict[str, float]:
    """Every request each worker started, by model (``pd_requests_total``, all outcomes), once two readings
    0.5 s apart agree (the workers publish their counters on their loops' ticks)."""
    def read() -> dict[str, float]:
        text = requests.get(metrics_url, timeout=5).text
        counts = {"prefill": 0.0, "decode": 0.0}
        for labels, value in re.findall(r"^pd_requests_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
            model = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("model")
            if model in counts:
                counts[model] += float(value)
        return counts

    last = read()
    for _ in range(20):
        time.sleep(0.5)
        now = read()
        if now == last:
            return now
        last = now
    return last


def assert_routers_serve(server: ServeScript, expected: str) -> None:
    for router in ROUTERS:
        result = grpc_generate(server.grpc_url, make_inputs(PROMPT, GREEDY), model=router)
        assert result.error is None and result.final_seen, (router, result.error, server.log_tail(4000))
        assert result.text == expected, (router, result.text, expected)


PATHS = ("tritonserver", "endpoint")


def send(server: ServeScript, path: str, role: str, prompt: bytes, room: int, signature: str,
         request_id: str = "") -> list[Delta]:
    """A direct ``role`` child request to that worker over ``path`` (its tritonserver gRPC or its own
    endpoint), with ``signature`` (and ``request_id`` instead of the call's own, when given)."""
    instance, endpoint = worker(server.log_path, role)
    if path == "endpoint":
        call = child_call(role, instance, endpoint, prompt, room, True)
        return through_endpoint(call, signature, request_id)
    call = child_call(role, instance, server.grpc_url, prompt, room, False)
    return through_triton(server.grpc_url, call, signature, request_id)


def test_the_fleet_serves_with_a_secret(server: ServeScript, expected: str) -> None:
    assert_routers_serve(server, expected)   # both routers found the workers (signed describe) and use them


@pytest.mark.parametrize("path", PATHS)
def test_an_unsigned_direct_decode_is_refused(server: ServeScript, expected: str, path: str) -> None:
    """Attack 2: a direct decode with a prompt of one's own, no signature."""
    before = worker_requests(server.metrics_url)
    assert_refused(send(server, path, "decode", ATTACK_PROMPT, 11, ""), "missing")
    assert worker_requests(server.metrics_url) == before   # no worker started anything for it
    assert_routers_serve(server, expected)


@pytest.mark.parametrize("path", PATHS)
def test_a_captured_prefill_signature_on_another_request_is_refused(server: ServeScript, expected: str,
                                                                    path: str) -> None:
    """Attack 3: a real signature of a router -> prefill request (as sniffed from the wire) put on a decode
    request of one's own: its request id kept, another prompt, model ``decode``."""
    prefill, prefill_endpoint = worker(server.log_path, "prefill")
    address = prefill_endpoint if path == "endpoint" else server.grpc_url
    prefill_call = child_call("prefill", prefill, address, PROMPT.encode(), 13, path == "endpoint")
    captured, captured_id = sign_child(prefill_call, SECRET), child_request_id(prefill_call)
    before = worker_requests(server.metrics_url)
    assert_refused(send(server, path, "decode", ATTACK_PROMPT, 13, captured, captured_id), "bad signature")
    assert worker_requests(server.metrics_url) == before
    assert_routers_serve(server, expected)


@pytest.mark.parametrize("first", PATHS)
def test_a_signed_request_is_served_once_and_refused_when_replayed_on_either_path(
        server: ServeScript, expected: str, first: str) -> None:
    """One replay guard per worker, shared by both paths: a signed request served on one path is refused when
    the same bytes come again on that path or the other."""
    room = 15 if first == "endpoint" else 16
    instance, _ = worker(server.log_path, "decode")
    signature = sign_child(child_call("decode", instance, "", PROMPT.encode(), room, False), SECRET)
    before = worker_requests(server.metrics_url)
    served = send(server, first, "decode", PROMPT.encode(), room, signature)
    assert served[-1].final and not served[-1].error and "".join(d.text for d in served) == expected
    for path in PATHS:
        assert_refused(send(server, path, "decode", PROMPT.encode(), room, signature), "replayed request")
    after = worker_requests(server.metrics_url)
    assert after == {"prefill": before["prefill"], "decode": before["decode"] + 1}, (before, after)
    assert_routers_serve(server, expected)
