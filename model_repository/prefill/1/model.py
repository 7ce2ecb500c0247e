"""Triton python-backend adapter of the prefill half of PD disaggregation (decoupled).

All logic lives in ``serving``: ``serving.triton_pd.PDChildModel`` builds a ``serving.prefill_worker.PrefillWorker``
(engine in prefill mode + NIXL KV manager) and hands it each request.
"""

from serving.triton_pd import PDChildModel


class TritonPythonModel(PDChildModel):
    ROLE = "prefill"
