"""An unload takes effect (issue #50 item 4), also when tritonserver 2.51 keeps holding the model: streams
read to their FINAL and then cancelled by the client (the race that leaves tritonserver's gRPC state of a
stream, and with it the model, unreleased: docs/healing.md, "Unloads"), then ``POST .../unload``.

Invariants: the unload answers 200; within the drain timeout the instance has either been finalized
(nothing held it) or, held, has drained and stopped serving on its own (its log says so); a new request to the
model is refused; the server's stop then ends by itself (within its exit timeout, no SIGKILL) and leaves no
stub or guardian running and no shared-memory region. Lean: the tiny colocated model, one server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs
from perf.server import Deployment, ServeScript, build_model_repository, shm_regions_of_group

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.timeout(600)]
DRAIN_S = 5


async def cancel_after_final(grpc_url: str, n: int) -> None:
    """``n`` short streams, each read to its FINAL and then cancelled (what a careless client does)."""
    import tritonclient.grpc.aio as grpcclient
    from perf.stream_client import stream_inputs

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        for i in range(n):
            inputs = stream_inputs("hi", json.dumps({"max_tokens": 4}))

            async def request(i: int = i, inputs=inputs):
                yield {"model_name": "colocated", "inputs": inputs, "request_id": str(i),
                       "parameters": {"triton_enable_empty_final_response": True}}
            responses = client.stream_infer(request())
            async for result, error in responses:
                assert error is None, error
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    break
            responses.cancel()
    finally:
        await client.close()


def test_an_unloaded_model_stops_serving_within_the_drain_even_when_held(tmp_path: Path) -> None:
    pytest.importorskip("pytriton")
    from perf.tiny_model import build_tiny_llama

    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    repo = build_model_repository(Deployment("c", "colocated", ("colocated",),
                                             overrides={"colocated": {"model": tiny}}), tmp_path / "models")
    server = ServeScript("colocated", tmp_path / "server.log", repo, env={"DRAIN_TIMEOUT_S": str(DRAIN_S)})
    server.start(180.0)
    assert server._proc is not None
    proc = server._proc
    regions = shm_regions_of_group(proc.pid)
    try:
        time.sleep(1.0)   # the server watch has seen the model ready (how it tells an unload from a start)
        asyncio.run(cancel_after_final(server.grpc_url, 9))
        url = f"{server.http_url}/v2/repository/models/colocated/unload"
        unload = urllib.request.Request(url, data=b"{}", method="POST")
        with urllib.request.urlopen(unload, timeout=60) as resp:
            assert resp.status == 200
        unloaded_s = time.monotonic()
        log = ""
        while time.monotonic() - unloaded_s < DRAIN_S + 5:
            log = server.log_path.read_text(errors="replace")
            if "finalized in" in log or "colocated unloaded: drained" in log:
                break
            time.sleep(0.2)
        held = "finalized in" not in log
        assert "finalized in" in log or "colocated unloaded: drained" in log, server.log_tail()
        late = grpc_generate(server.grpc_url, make_inputs("late", {"max_tokens": 4}), model="colocated")
        assert late.error is not None
        how = "held by tritonserver: the instance stopped serving" if held else "finalized at once"
        print(f"unload {how} {time.monotonic() - unloaded_s:.1f} s after the unload's 200")
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)   # a held model: tritonserver waits out its exit timeout
        proc.wait(DRAIN_S + 15 + 10)
        stop_s = time.monotonic() - began
        time.sleep(1.0)   # the guardian, should it have had to kill the stub, is gone by then
        left = [pid for pid in group_pids(proc.pid)]
        leaked = [r for r in regions if Path("/dev/shm", r).exists()]
    finally:
        server.stop(30.0)   # whatever a failure left
    print(f"the server's stop took {stop_s:.1f} s")
    assert not left and not leaked, (left, leaked, server.log_tail())


def group_pids(pgid: int) -> list[int]:
    """Processes still running (no zombie) in group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
                if os.getpgid(int(entry.name)) == pgid and state not in ("Z", "X"):
                    out.append(int(entry.name))
            except (OSError, ProcessLookupError, IndexError):
                continue
    return out
