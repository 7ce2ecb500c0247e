"""Triton python-backend adapter of the decode half of PD disaggregation (decoupled).

All logic lives in ``serving``: ``serving.triton_pd.PDChildModel`` builds a ``serving.decode_worker.DecodeWorker``
(engine in decode mode + NIXL KV manager) and hands it each request.
"""

from serving.triton_pd import PDChildModel


class TritonPythonModel(PDChildModel):
    ROLE = "decode"
