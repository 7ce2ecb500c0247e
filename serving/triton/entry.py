"""``deferred_model``: a model.py's ``TritonPythonModel`` whose real class is imported in ``initialize``.

Why: at every load of a python-backend model, tritonserver (auto-complete on: its default) first starts a
short-lived "auto-complete" stub that imports model.py only to ask ``TritonPythonModel`` for
``auto_complete_config`` (python_backend ``src/python_be.cc``: ``TRITONBACKEND_ModelInitialize`` →
``LaunchAutoCompleteStubProcess``), stops it, then starts the instance's stub, which imports model.py again.
Our model.py files imported the serving code at their top (torch, NIXL: 3–5 s on an idle core), so every start
paid that import twice: in the chaos run, 22 s of a healed prefill server's 45 s start went to the
auto-complete stub alone (docs/healing.md). A deferred model.py imports only this module (standard library),
so the auto-complete stub ends at once; the instance's stub imports the real class in ``initialize``.

The instance's stub guardian (``serving.triton.stub_guard``, standard library only) starts first in
``initialize``, before the real class is imported: from then on a tritonserver that dies under the loading
stub (a SIGTERM before tritonserver installed its handler kills it at once) has the stub killed and its shared
memory removed, instead of python_backend's own teardown crashing it (docs/healing.md, "Stops").

Every ``config.pbtxt`` leaves its model's outputs (and a client model's ``return_*`` inputs) out: the deferred
class declares them from ``serving.schema`` by the model's role, in ``auto_complete_config`` (the hook that
stub calls), so a new output is a row of the schema and no config edit. A tritonserver started with
``--disable-auto-complete-config`` never calls it: then ``initialize`` fails the load, naming that flag, when
the config it got lacks them (``check_declared``).

At import time nothing here imports Triton, torch or the rest of ``serving`` but ``serving.schema`` (standard
library only).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from serving.schema import config_inputs, config_outputs, layout_of, undeclared


class UndeclaredOutputs(RuntimeError):
    """The model's config lacks the schema's outputs: auto-complete did not run."""


def complete_config(auto_complete_model_config: Any, role: str) -> Any:
    """The python backend's ``auto_complete_config`` for a model of ``role`` (``serving.schema.layout_of``):
    adds the schema's inputs and outputs of that role (``config_inputs``, ``config_outputs``) to
    ``auto_complete_model_config`` (``pb_utils.ModelConfig``: ``add_input``, ``add_output``; one the config
    already declares alike is kept, one it declares otherwise fails the load with the backend's ValueError)
    and returns it."""
    for entry in config_inputs(role):
        auto_complete_model_config.add_input(entry)
    for entry in config_outputs(role):
        auto_complete_model_config.add_output(entry)
    return auto_complete_model_config


def check_declared(model_config: dict[str, Any], role: str) -> None:
    """Raises ``UndeclaredOutputs`` when ``model_config`` (``args["model_config"]``, parsed) lacks any of the
    schema's inputs and outputs of ``role``, naming them and ``--disable-auto-complete-config``."""
    missing = undeclared(model_config, role)
    if missing:
        raise UndeclaredOutputs(
            f"model {model_config.get('name', '?')!r} lacks what serving.schema declares for its role "
            f"{role!r}: was tritonserver started with --disable-auto-complete-config? Its config.pbtxt "
            f"leaves them to model.py's auto_complete_config, which that flag skips; start tritonserver "
            f"without it. "
            f"Missing: {', '.join(missing)}")


def deferred_model(module: str, class_name: str, role: str, **attributes: object) -> type:
    """A ``TritonPythonModel`` class delegating to ``module.class_name``, which is imported and instantiated
    (no arguments, then ``attributes`` set on the instance) in ``initialize``, on the instance's stub.

    Args:
        module: dotted module of the real model class, e.g. ``"serving.triton.pd_model"``.
        class_name: the class, e.g. ``"PDChildModel"``.
        role: the model's role in ``serving.schema`` (``"colocated"``, ``"pd_ensemble"``, ``"prefill"``,
            ``"decode"``): its ``auto_complete_config`` declares that role's outputs, and ``initialize``
            checks them. Raises ValueError for an unknown one.
        attributes: instance attributes the real class reads in ``initialize`` (``ROLE="prefill"``); the
            started ``StubGuard`` is set as ``stub_guard`` too.

    Errors of the check, of the import or of the real ``initialize`` propagate (Triton then fails the model's
    load with them).
    """
    layout_of(role)   # an unknown role fails at import of model.py, not at a load

    class TritonPythonModel:
        __doc__ = f"Deferred to {module}.{class_name} (serving.triton.entry), role {role!r}."

        @staticmethod
        def auto_complete_config(auto_complete_model_config: Any) -> Any:
            return complete_config(auto_complete_model_config, role)

        def initialize(self, args: dict[str, Any]) -> None:
            from serving.triton.stub_guard import StubGuard

            guard = self._guard = StubGuard(str(args.get("model_name", ""))).start()
            try:
                check_declared(json.loads(args["model_config"]), role)
                model = getattr(importlib.import_module(module), class_name)()
                for name, value in {**attributes, "stub_guard": guard}.items():
                    setattr(model, name, value)
                self._model = model
                model.initialize(args)
            except BaseException:
                guard.stop()   # idempotent: the real class may have stopped it already
                raise

        def execute(self, requests: list[Any]) -> Any:
            return self._model.execute(requests)

        def finalize(self) -> None:
            model = getattr(self, "_model", None)
            if model is not None:
                model.finalize()
            guard = getattr(self, "_guard", None)
            if guard is not None:
                guard.stop()   # idempotent: the real class stops it at the end of its own finalize

    return TritonPythonModel
