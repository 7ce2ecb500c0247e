"""Triton python-backend adapter of the colocated worker (decoupled).

All logic lives in ``serving``: ``serving.triton.colocated_model.ColocatedModel`` builds a ``ColocatedWorker``
(one engine) and hands it each request. It is imported in ``initialize`` only (``serving.triton.entry``: the
python backend's auto-complete stub imports this file too, and need not load torch).
"""

from serving.triton.entry import deferred_model

TritonPythonModel = deferred_model("serving.triton.colocated_model", "ColocatedModel", "colocated")
