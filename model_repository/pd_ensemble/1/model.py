"""Triton python-backend adapter of pd_ensemble, the public entry point of PD disaggregation (BLS, decoupled).

All logic lives in ``serving``: ``serving.triton_pd.PDEnsembleModel`` allocates a bootstrap room per request,
pairs a prefill and a decode model round robin, calls both (decoupled BLS) and merges their streams
(``serving.orchestrator``).
"""

from serving.triton_pd import PDEnsembleModel


class TritonPythonModel(PDEnsembleModel):
    pass
