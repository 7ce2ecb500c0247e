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

At import time nothing here imports Triton, torch or the rest of ``serving``.
"""

from __future__ import annotations

import importlib
from typing import Any


def deferred_model(module: str, class_name: str, **attributes: object) -> type:
    """A ``TritonPythonModel`` class delegating to ``module.class_name``, which is imported and instantiated
    (no arguments, then ``attributes`` set on the instance) in ``initialize``, on the instance's stub.

    Args:
        module: dotted module of the real model class, e.g. ``"serving.triton.pd_model"``.
        class_name: the class, e.g. ``"PDChildModel"``.
        attributes: instance attributes the real class reads in ``initialize`` (``ROLE="prefill"``); the
            started ``StubGuard`` is set as ``stub_guard`` too.

    Errors of the import or of the real ``initialize`` propagate (Triton then fails the model's load with
    them).
    """

    class TritonPythonModel:
        __doc__ = f"Deferred to {module}.{class_name} (serving.triton.entry)."

        def initialize(self, args: dict[str, Any]) -> None:
            from serving.triton.stub_guard import StubGuard

            guard = self._guard = StubGuard(str(args.get("model_name", ""))).start()
            try:
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
