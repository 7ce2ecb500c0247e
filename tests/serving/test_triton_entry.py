"""model.py files defer the serving code to ``initialize``: importing one (what the python backend's
auto-complete stub does at every load) loads neither torch nor the rest of ``serving`` (only
``serving.triton.entry`` and its packages, whose ``__init__`` holds a docstring); the deferred model
imports its class, sets its attributes and delegates."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from serving.triton.entry import deferred_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["colocated", "prefill", "decode", "pd_ensemble"])
def test_importing_a_model_py_loads_no_torch_and_no_serving_code(model: str) -> None:
    code = ("import runpy, sys; ns = runpy.run_path(sys.argv[1]); ns['TritonPythonModel']();"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'nixl', 'engine')"
            " or (m.startswith('serving.') and m not in ('serving.triton', 'serving.triton.entry')));"
            "print(heavy); sys.exit(1 if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code,
                           str(ROOT / "model_repository" / model / "1" / "model.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


class FakeGuard:
    """Records what the deferred model does with its stub guardian."""

    def __init__(self, calls: list[tuple[str, object]]) -> None:
        self.calls = calls

    def __call__(self, model_name: str) -> FakeGuard:
        self.calls.append(("guard", model_name))
        return self

    def start(self) -> FakeGuard:
        self.calls.append(("guard start", None))
        return self

    def stop(self) -> None:
        self.calls.append(("guard stop", None))


def test_the_deferred_model_imports_its_class_in_initialize_and_delegates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub's guardian starts before the real class is imported (it watches tritonserver while the model
    loads), is handed to the real class, and is stopped after its ``finalize``."""
    import serving.triton.stub_guard as stub_guard

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(stub_guard, "StubGuard", FakeGuard(calls))

    class Real:
        ROLE = ""

        def initialize(self, args: dict[str, object]) -> None:
            calls.append(("initialize", (self.ROLE, args, type(self.stub_guard).__name__)))

        def execute(self, requests: list[object]) -> None:
            calls.append(("execute", requests))

        def finalize(self) -> None:
            calls.append(("finalize", None))

    module = types.ModuleType("fake_real_model")
    module.Real = Real  # type: ignore[attr-defined]
    cls = deferred_model("fake_real_model", "Real", ROLE="decode")
    model = cls()
    model.finalize()   # before initialize (a failed load): nothing to finalize
    monkeypatch.setitem(sys.modules, "fake_real_model", module)
    model.initialize({"model_name": "m"})
    assert model.execute(["r1"]) is None
    model.finalize()
    assert calls == [("guard", "m"), ("guard start", None),
                     ("initialize", ("decode", {"model_name": "m"}, "FakeGuard")), ("execute", ["r1"]),
                     ("finalize", None), ("guard stop", None)]


def test_a_missing_module_fails_initialize_with_the_import_error_and_stops_the_guardian(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import serving.triton.stub_guard as stub_guard

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(stub_guard, "StubGuard", FakeGuard(calls))
    with pytest.raises(ModuleNotFoundError):
        deferred_model("no_such_module_here", "X")().initialize({"model_name": "m"})
    assert calls == [("guard", "m"), ("guard start", None), ("guard stop", None)]
