"""Triton python-backend adapter of the prefill half of PD disaggregation (decoupled).

All logic lives in ``serving``: ``serving.triton.pd_model.PDChildModel`` builds a
``serving.workers.prefill.PrefillWorker`` (engine in prefill mode + KV manager) and hands it each request. It
is imported in ``initialize`` only (``serving.triton.entry``: the python backend's auto-complete stub imports
this file too, and need not load torch).
"""

from serving.triton.entry import deferred_model

TritonPythonModel = deferred_model("serving.triton.pd_model", "PDChildModel", "prefill", ROLE="prefill")
