"""model.py files defer the serving code to ``initialize``: importing one and asking it for its config (what
the python backend's auto-complete stub does at every load) loads neither torch nor the rest of ``serving``
(only ``serving.triton.entry``, ``serving.schema`` and their packages, whose ``__init__`` holds a docstring);
the deferred model checks its config holds the schema, imports its class, sets its attributes and
delegates."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from serving.schema import config_outputs
from serving.triton.entry import UndeclaredOutputs, deferred_model

ROOT = Path(__file__).resolve().parents[2]
#: ``args["model_config"]`` of a decode model whose config holds the schema (auto-complete ran)
DECODE_CONFIG = json.dumps({"name": "m", "input": [], "output": config_outputs("decode")})


@pytest.mark.parametrize("model", ["colocated", "prefill", "decode", "pd_ensemble"])
def test_importing_a_model_py_loads_no_torch_and_no_serving_code(model: str) -> None:
    code = ("import runpy, sys; ns = runpy.run_path(sys.argv[1]); ns['TritonPythonModel']();"
            "import types; c = {'input': [], 'output': []};"
            "fake = types.SimpleNamespace(add_input=c['input'].append, add_output=c['output'].append);"
            "ns['TritonPythonModel'].auto_complete_config(fake); assert c['output'], c;"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'nixl', 'engine')"
            " or (m.startswith('serving.') and m not in ('serving.triton', 'serving.triton.entry',"
            " 'serving.schema')));"
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
    cls = deferred_model("fake_real_model", "Real", "decode", ROLE="decode")
    model = cls()
    model.finalize()   # before initialize (a failed load): nothing to finalize
    monkeypatch.setitem(sys.modules, "fake_real_model", module)
    args = {"model_name": "m", "model_config": DECODE_CONFIG}
    model.initialize(args)
    assert model.execute(["r1"]) is None
    model.finalize()
    assert calls == [("guard", "m"), ("guard start", None),
                     ("initialize", ("decode", args, "FakeGuard")), ("execute", ["r1"]),
                     ("finalize", None), ("guard stop", None)]


def test_a_missing_module_fails_initialize_with_the_import_error_and_stops_the_guardian(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import serving.triton.stub_guard as stub_guard

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(stub_guard, "StubGuard", FakeGuard(calls))
    with pytest.raises(ModuleNotFoundError):
        deferred_model("no_such_module_here", "X", "decode")().initialize(
            {"model_name": "m", "model_config": DECODE_CONFIG})
    assert calls == [("guard", "m"), ("guard start", None), ("guard stop", None)]


def test_a_config_without_the_schema_fails_initialize_before_the_import_and_stops_the_guardian(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server under ``--disable-auto-complete-config``: the load fails with the flag's name, and the real
    class (torch, the engine) is never imported."""
    import serving.triton.stub_guard as stub_guard

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(stub_guard, "StubGuard", FakeGuard(calls))
    with pytest.raises(UndeclaredOutputs, match="--disable-auto-complete-config"):
        deferred_model("no_such_module_here", "X", "decode")().initialize(
            {"model_name": "m", "model_config": json.dumps({"name": "m", "input": [], "output": []})})
    assert calls == [("guard", "m"), ("guard start", None), ("guard stop", None)]


def test_an_unknown_role_fails_at_import_of_model_py() -> None:
    with pytest.raises(ValueError, match="unknown model role"):
        deferred_model("serving.triton.pd_model", "PDChildModel", "prefill_1")
