"""Triton python-backend adapter of pd_ensemble, the public entry point and router of PD disaggregation.

All logic lives in ``serving.router``: ``serving.router.triton_model.RouterModel`` admits each request, pairs
a healthy prefill and decode instance of the fleet (in this tritonserver or others, found at the bootstrap
service) by load, sends both child requests over gRPC streaming, merges their streams, and retries a request
that failed before its first token on another pair.
It is imported in ``initialize`` only (``serving.triton.entry``: the python backend's auto-complete stub
imports this file too, and need not load torch).
"""

from serving.triton.entry import deferred_model

TritonPythonModel = deferred_model("serving.router.triton_model", "RouterModel", "pd_ensemble")
