"""Healing on one tritonserver (``pd_ensemble``, ``prefill``, ``decode``, started by serve.sh).

Invariants: unloading and loading ``prefill``, and reloading ``decode`` in place (a load with a changed
config), through Triton's repository API while requests stream through the router never stops the router or
another model's loop: a long request in flight runs to its last token on the old version, every stream ends
(FINAL or one error; through the reload in place, no error at all), after each reload new requests give the
colocated text, and the new version's metric series are still on ``/metrics`` once the old version is gone
(the old version deleting a series it shared with the new one was a use-after-free in tritonserver that
aborted it: ``serving.metrics``). ``kill -9`` of the prefill stub: within seconds the server stops reporting
``prefill`` ready (its stub's guardian ends the server), serve.sh starts it again, and requests through the
router give the colocated text again within 30 s (or, on a machine so loaded that one start of the server
takes longer, within 1.5x its first start). A server that never became ready (a model that does not load) is a
start-up failure: serve.sh exits with it instead of starting it again and again. The fixture's teardown checks
the server then stops cleanly within 15 s with no stub fault.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from live_client import StreamResult, finished_requests, grpc_generate, make_inputs
from live_prompts import colocated_greedy_texts
from perf.server import ServeScript

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(1200)]
TRITON_MODELS = ("pd_ensemble", "prefill", "decode")
GREEDY = {"max_tokens": "12", "temperature": "0"}
PROMPTS = ["The capital of France is", "Once upon a time"]
LONG = {"max_tokens": "120", "temperature": "0", "ignore_eos": "true"}
HEAL_S = 30.0


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS, GREEDY)


def generate(server: ServeScript, prompt: str, params: dict[str, str] = GREEDY) -> StreamResult:
    return grpc_generate(server.grpc_url, make_inputs(prompt, params), model="pd_ensemble")


def model_ready(server: ServeScript, model: str) -> bool:
    try:
        return requests.get(f"{server.http_url}/v2/models/{model}/ready", timeout=5).status_code == 200
    except requests.ConnectionError:   # the server is down (restarting)
        return False


def repository(server: ServeScript, model: str, action: str) -> None:
    """POST the repository API's ``load``/``unload`` (a load returns once the new version is ready)."""
    resp = requests.post(f"{server.http_url}/v2/repository/models/{model}/{action}", timeout=600,
                         headers={"Connection": "close"})   # an idle kept-alive connection delays the stop
    assert resp.status_code == 200, resp.text


def finished(server: ServeScript, model: str) -> float:
    return finished_requests(server.metrics_url, model)


class Traffic:
    """Short greedy requests through the router, one after another on a thread, until the ``with`` ends."""

    def __init__(self, server: ServeScript) -> None:
        self.results: list[StreamResult] = []
        self._server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(generate(self._server, PROMPTS[0]))
            except Exception as e:   # no response within live_client's timeout: recorded, the test reads it
                self.results.append(StreamResult(error=f"client: {type(e).__name__} {e}"))
            time.sleep(0.2)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(300)


def start_long_request(server: ServeScript, pool: ThreadPoolExecutor,
                       params: dict[str, str]) -> Future[StreamResult]:
    """A long request through the router, returned once its prefill is done (it decodes on the current decode
    version, and no prefill holds it any more)."""
    before = finished(server, "prefill")
    long = pool.submit(generate, server, "Write a long story about a lighthouse keeper.", params)
    deadline = time.monotonic() + 120
    while finished(server, "prefill") <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return long


def wait_for_series_of(server: ServeScript, model: str, pid: int) -> set[str]:
    """The ``pid`` labels of ``model``'s ``pd_kv_total_pages`` once they are the new stub ``pid``'s alone, or
    after 10 s whatever they are: the new version's series must still be there after the old one's went."""
    deadline = time.monotonic() + 10
    while series_pids(server, "pd_kv_total_pages", model) != {str(pid)} and time.monotonic() < deadline:
        time.sleep(0.2)
    return series_pids(server, "pd_kv_total_pages", model)


def reload_under_traffic(server: ServeScript, model: str) -> tuple[StreamResult, list[StreamResult]]:
    """A long request decoding, then ``model`` unloaded and loaded again while short ones keep coming; returns
    the long request's result (it ends on the old version) and the short ones'."""
    with Traffic(server) as traffic, ThreadPoolExecutor(1) as pool:
        long = start_long_request(server, pool, LONG)
        repository(server, model, "unload")
        repository(server, model, "load")
        time.sleep(1.0)
        result = long.result(timeout=600)
    return result, traffic.results


#: A request that outlasts a reload of decode on this host (the new version loads in ~6 s, more under load).
LONGER = {"max_tokens": "200", "temperature": "0", "ignore_eos": "true"}


def test_reloading_decode_in_place_under_traffic_fails_no_new_request(triton_server: ServeScript,
                                                                      reference) -> None:
    """A reload in place (a load of the loaded ``decode`` with a changed config: tritonserver starts the new
    version beside the old one, swaps, then unloads the old one, whose ``finalize`` waits for its streams)
    while a long request decodes on the old version and short ones keep coming. The old version lists itself
    draining at its rendezvous, so the router stops pairing it and asks the model again, finding the new
    version within a refresh: no short request fails (before, every one failed until the old version's last
    stream ended, a trial's 3-14 s), and the long one ends on the old version with every token."""
    server = triton_server
    config = requests.get(f"{server.http_url}/v2/models/decode/config", timeout=10).json()
    config["parameters"]["waiting_timeout_s"]["string_value"] = "121"   # a change: the load is a reload
    old = stub_pid(server, "decode")
    with Traffic(server) as traffic, ThreadPoolExecutor(1) as pool:
        long = start_long_request(server, pool, LONGER)   # decoding on the old version
        began_s = time.monotonic()
        resp = requests.post(f"{server.http_url}/v2/repository/models/decode/load",
                             json={"parameters": {"config": json.dumps(config)}}, timeout=600,
                             headers={"Connection": "close"})
        assert resp.status_code == 200, resp.text
        swapped_s = time.monotonic()
        assert not long.done(), "the long request ended before the swap: nothing was left to drain"
        while len(stub_pids_of(server, "decode")) > 1 and time.monotonic() - swapped_s < 120:
            time.sleep(0.2)   # the old version drains its long stream, then exits
        drained_s = time.monotonic()
        time.sleep(1.0)
        result = long.result(timeout=600)
    print(f"decode reloaded in {swapped_s - began_s:.1f} s; the old version drained "
          f"{drained_s - swapped_s:.1f} s after; {len(traffic.results)} short requests meanwhile")
    assert result.error is None and result.final_seen, result.error
    assert result.num_output_tokens[-1] == int(LONGER["max_tokens"])
    failed = [r.error for r in traffic.results if r.error]
    assert not failed, \
        f"{len(failed)} of {len(traffic.results)} requests failed during the reload: {failed[:3]}"
    assert len(traffic.results) >= 5 and {r.text for r in traffic.results} == {reference[PROMPTS[0]]}
    new = stub_pid(server, "decode")
    assert new != old
    assert wait_for_series_of(server, "decode", new) == {str(new)}


def series_pids(server: ServeScript, name: str, model: str) -> set[str]:
    """The ``pid`` labels of ``name``'s series of ``model`` on the server's metrics endpoint."""
    text = requests.get(server.metrics_url, timeout=5).text
    return {line.partition('pid="')[2].partition('"')[0] for line in text.splitlines()
            if line.startswith(name + "{") and f'model="{model}"' in line}


def test_reloading_prefill_or_decode_never_stops_the_router_or_the_other_loop(triton_server: ServeScript,
                                                                               reference) -> None:
    server = triton_server
    # decode: unloaded and loaded again here until 2026-12-04; now reloaded in place, with the same checks and
    # more, by test_reloading_decode_in_place_under_traffic_fails_no_new_request (CI's time)
    model = "prefill"
    old = stub_pid(server, model)
    long, short = reload_under_traffic(server, model)
    assert long.error is None and long.final_seen, (model, long.error)   # it ran through the reload
    assert long.num_output_tokens[-1] == int(LONG["max_tokens"])
    assert short and all(r.final_seen or r.error for r in short), "every stream ends"
    assert not [r.error for r in short if r.error and "not running" in r.error], model
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        after = list(pool.map(lambda p: generate(server, p), PROMPTS))
    assert [(r.error, r.text) for r in after] == [(None, reference[p]) for p in PROMPTS], model
    deadline = time.monotonic() + 30   # the old version finalizes after its last request: one stub left
    while len(stub_pids_of(server, model)) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    new = stub_pid(server, model)
    assert new != old
    found = wait_for_series_of(server, model, new)
    assert found == {str(new)}, f"{model}: the new stub {new}'s series, not {found} (old stub {old})"


def stub_pids_of(server: ServeScript, model: str) -> list[int]:
    needle = f"/{model}/1/model.py".encode()
    pids = []
    for pid in server.stub_pids():
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:   # exited meanwhile
            continue
    return pids


def stub_pid(server: ServeScript, model: str) -> int:
    pids = stub_pids_of(server, model)
    assert len(pids) == 1, pids
    return pids[0]


def test_a_killed_prefill_stub_is_replaced_with_its_server_and_serves_again(triton_server: ServeScript,
                                                                            reference) -> None:
    server = triton_server
    assert generate(server, PROMPTS[0]).text == reference[PROMPTS[0]]
    old = stub_pid(server, "prefill")
    os.kill(old, signal.SIGKILL)
    killed_s = time.monotonic()
    while model_ready(server, "prefill"):   # the truth: a model whose stub is dead is not served
        assert time.monotonic() - killed_s < 10.0, "prefill still reported ready 10 s after its stub died"
        time.sleep(0.1)
    unready_s = time.monotonic() - killed_s
    # healing is a server restart: on a loaded 2-core host one start alone can take longer than the 30 s
    # target (docs/healing.md), so the bound is the target or 1.5x this server's own first start, whichever is
    # longer
    bound_s = max(HEAL_S, 1.5 * getattr(server, "start_seconds", 0.0))
    while True:
        try:
            result = generate(server, PROMPTS[0])
        except Exception as e:   # the server is down while it restarts
            result = StreamResult(error=str(e))
        if result.error is None:
            break
        assert time.monotonic() - killed_s < bound_s, f"not healed within {bound_s:.0f} s: {result.error}"
        time.sleep(0.5)
    healed_s = time.monotonic() - killed_s
    print(f"prefill stub killed: not ready after {unready_s:.1f} s, serving again after {healed_s:.1f} s "
          f"(the server's first start took {getattr(server, 'start_seconds', float('nan')):.1f} s; load "
          f"{os.getloadavg()})")
    assert result.text == reference[PROMPTS[0]]
    assert stub_pid(server, "prefill") != old and model_ready(server, "prefill")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        after = list(pool.map(lambda p: generate(server, p), PROMPTS))
    assert [(r.error, r.text) for r in after] == [(None, reference[p]) for p in PROMPTS]


def test_a_server_that_never_becomes_ready_is_not_restarted(tmp_path: Path) -> None:
    """serve.sh restarts tritonserver only after it had been ready once: a model that cannot load ends
    serve.sh with tritonserver's failure status, after one start."""
    server = ServeScript("no_such_model", tmp_path / "serve.log")
    with pytest.raises(RuntimeError, match="exited"):
        server.start(timeout_s=120)
    log = server.log_path.read_text(errors="replace")
    assert log.count("starting it again") == 0, log[-3000:]
    assert "no_such_model" in log
    server.stop(10)
