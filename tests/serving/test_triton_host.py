"""``serving.triton.host.ModelHost``: the order of the shared lifecycle (what starts before the adapter's
service, what stops before and after it), the server-stop hook, and a failed ``start`` that leaves nothing
running. The python backend, the watches and the metrics are fakes that record what happens to them."""

from __future__ import annotations

import json
import time
import types
from typing import Any

import pytest

import serving.triton.host as host_module
from serving.triton.host import ModelHost


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.drain_timeouts: list[float] = []


def _fake_watch(log: _Recorder, name: str) -> type:
    class Watch:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.args = args
            if name == "server_watch":
                log.server_stop = args[-1]   # type: ignore[attr-defined]
                log.unloaded = kwargs.get("on_unload")   # type: ignore[attr-defined]

        def start(self) -> Watch:
            log.events.append(f"{name} start")
            return self

        def stop(self, timeout_s: float = 5.0) -> None:
            log.events.append(f"{name} stop")

        def arm(self, grpc_url: str, tls: Any = None, drain_timeout_s: float = 30.0) -> None:
            log.events.append(f"{name} arm")

        def ending(self) -> None:
            log.events.append(f"{name} ending")

    return Watch


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()

    class Metrics:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            rec.events.append("metrics open")

        def close(self) -> None:
            rec.events.append("metrics close")

    class Dispatcher:
        def start(self) -> None:
            rec.events.append("responses start")

        def stop(self, timeout_s: float) -> bool:
            rec.events.append("responses stop")
            return True

    pb = types.SimpleNamespace(MetricFamily=object, TritonModelException=RuntimeError,
                               using_decoupled_model_transaction_policy=lambda config: config.get(
                                   "decoupled", False))
    monkeypatch.setattr(host_module, "pb_utils", lambda: pb)
    monkeypatch.setattr(host_module, "ServingMetrics", Metrics)
    monkeypatch.setattr(host_module, "new_dispatcher", lambda name: Dispatcher())
    monkeypatch.setattr(host_module, "OrphanWatch", _fake_watch(rec, "orphan_watch"))
    monkeypatch.setattr(host_module, "ServerShutdownWatch", _fake_watch(rec, "server_watch"))
    monkeypatch.setattr(host_module, "StubGuard", _fake_watch(rec, "stub_guard"))
    return rec


class _Adapter(ModelHost):
    fail_start = False

    def __init__(self, log: _Recorder) -> None:
        self.log = log

    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        self.log.events.append("service start")
        if self.fail_start:
            raise ValueError("bad parameter")
        return "127.0.0.1:8001"

    def drain(self, timeout_s: float) -> int:
        self.log.events.append("service drain")
        self.log.drain_timeouts.append(timeout_s)   # type: ignore[attr-defined]
        return 0

    def stop(self, timeout_s: float) -> None:
        self.log.events.append("service stop")

    def handle(self, request: Any, sink: Any) -> None:
        raise AssertionError("not called here")


def _args(decoupled: bool = True) -> dict[str, Any]:
    return {"model_name": "m", "model_instance_name": "m_0_0",
            "model_config": json.dumps({"decoupled": decoupled})}


def test_the_watches_start_after_the_service_and_stop_before_it(log: _Recorder) -> None:
    """The guardian first (it watches tritonserver while the model loads) and armed last; at ``finalize`` told
    first, reaped last with the orphan watch: a server that dies while this stub drains still ends it at
    once."""
    model = _Adapter(log)
    model.initialize(_args())
    assert log.events == ["stub_guard start", "metrics open", "responses start", "service start",
                          "orphan_watch start", "server_watch start", "stub_guard arm"]
    log.events.clear()
    model.finalize()
    assert log.events == ["stub_guard ending", "server_watch stop", "service drain", "service stop",
                          "responses stop", "metrics close", "stub_guard stop", "orphan_watch stop"]
    assert 29.0 < log.drain_timeouts[0] <= model.drain_timeout_s == 30.0


def test_a_server_stop_drains_then_stops_the_service_within_one_deadline(log: _Recorder) -> None:
    model = _Adapter(log)
    model.drain_timeout_s = 2.0
    model.initialize(_args())
    log.events.clear()
    log.server_stop()   # type: ignore[attr-defined]   # what ServerShutdownWatch calls
    assert log.events == ["service drain", "service stop"]
    time.sleep(0.5)
    model.finalize()   # drained again within what is left of the same deadline, stopped again (idempotent)
    assert log.events[2:5] == ["stub_guard ending", "server_watch stop", "service drain"]
    assert log.events[-1] == "orphan_watch stop"
    first, second = log.drain_timeouts
    assert 1.9 < first <= 2.0 and second < first - 0.4


def test_a_failed_start_leaves_no_thread_and_no_metric_behind(log: _Recorder) -> None:
    model = _Adapter(log)
    model.fail_start = True
    with pytest.raises(ValueError, match="bad parameter"):
        model.initialize(_args())
    assert log.events == ["stub_guard start", "metrics open", "responses start", "service start",
                          "responses stop", "metrics close", "stub_guard stop"]


def test_a_model_that_is_not_decoupled_fails_before_anything_but_its_guardian_starts(log: _Recorder) -> None:
    with pytest.raises(RuntimeError, match="decoupled"):
        _Adapter(log).initialize(_args(decoupled=False))
    assert log.events == ["stub_guard start", "stub_guard stop"]


def test_an_unload_seen_by_the_watch_drains_and_stops_the_service(log: _Recorder) -> None:
    """tritonserver reports the model not ready while the instance runs (an unload it does not finalize at
    once): the service drains, then stops; ``finalize`` later finds it stopped (stop is idempotent)."""
    model = _Adapter(log)
    model.initialize(_args())
    log.events.clear()
    log.unloaded()   # type: ignore[attr-defined]   # what ServerShutdownWatch calls
    assert log.events == ["service drain", "service stop"]
    model.finalize()
    assert log.events[-1] == "orphan_watch stop"
