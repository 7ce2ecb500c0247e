"""``serving.triton.host.ModelHost``: the order of the shared lifecycle (what starts before the adapter's
service, what stops before and after it), the server-stop hook, and a failed ``start`` that leaves nothing
running. The python backend, the watches and the metrics are fakes that record what happens to them."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

import serving.triton.host as host_module
from serving.triton.host import ModelHost


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []


def _fake_watch(log: _Recorder, name: str) -> type:
    class Watch:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.args = args
            if name == "server_watch":
                log.server_stop = args[-1]   # type: ignore[attr-defined]

        def start(self) -> Watch:
            log.events.append(f"{name} start")
            return self

        def stop(self) -> None:
            log.events.append(f"{name} stop")

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
                               using_decoupled_model_transaction_policy=lambda config: config.get("decoupled", False))
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

    def stop(self, timeout_s: float) -> None:
        self.log.events.append("service stop")

    def handle(self, request: Any, sink: Any) -> None:
        raise AssertionError("not called here")


def _args(decoupled: bool = True) -> dict[str, Any]:
    return {"model_name": "m", "model_instance_name": "m_0_0",
            "model_config": json.dumps({"decoupled": decoupled})}


def test_the_watches_start_after_the_service_and_stop_before_it(log: _Recorder) -> None:
    model = _Adapter(log)
    model.initialize(_args())
    assert log.events == ["metrics open", "responses start", "service start", "orphan_watch start",
                          "server_watch start", "stub_guard start"]
    log.events.clear()
    model.finalize()
    assert log.events == ["stub_guard stop", "server_watch stop", "orphan_watch stop", "service stop",
                          "responses stop", "metrics close"]


def test_a_server_stop_stops_the_service(log: _Recorder) -> None:
    model = _Adapter(log)
    model.initialize(_args())
    log.events.clear()
    log.server_stop()   # type: ignore[attr-defined]   # what ServerShutdownWatch calls
    assert log.events == ["service stop"]
    model.finalize()   # the service is stopped again (stop is idempotent), then the rest as always
    assert log.events[-1] == "metrics close"


def test_a_failed_start_leaves_no_thread_and_no_metric_behind(log: _Recorder) -> None:
    model = _Adapter(log)
    model.fail_start = True
    with pytest.raises(ValueError, match="bad parameter"):
        model.initialize(_args())
    assert log.events == ["metrics open", "responses start", "service start", "responses stop", "metrics close"]


def test_a_model_that_is_not_decoupled_fails_before_anything_starts(log: _Recorder) -> None:
    with pytest.raises(RuntimeError, match="decoupled"):
        _Adapter(log).initialize(_args(decoupled=False))
    assert log.events == []
