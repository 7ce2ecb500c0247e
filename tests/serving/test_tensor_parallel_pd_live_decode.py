"""PD between different TP sizes in one real tritonserver (issue #45 item 2), on the tiny random Llama of
``test_tensor_parallel_pd_live.py`` (whose helpers this module shares):

* ``pd_ensemble``: prefill at ``tensor_parallel_size`` 1 → decode at 2, over NIXL: each decode rank received
  its KV head;
* ``pd_mooncake``: prefill at 2 → decode at 1, over Mooncake (``kv_backend: mooncake``; each prefill rank's KV
  heads written into the decode's pages as one span per page, ``kv_transfer/head_slices.py``), its own pair
  held by ``prefill_models`` / ``decode_models``.

Every stream equals a colocated TP=1 engine's greedy run (text, token ids, logprobs within ``LOGPROB_TOL``).
One server for both pairs: the second pair costs its models' load, not a server start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from perf.server import Deployment, build_model_repository
from test_tensor_parallel_pd_live import check_streams_equal_colocated_tp1, tiny

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.mooncake,
              pytest.mark.timeout(900)]
#: read by the triton_server fixture
TRITON_MODELS = ("pd_ensemble", "prefill", "decode", "pd_mooncake", "prefill_mooncake", "decode_mooncake")


def make_model_repository(tmp_dir: Path) -> Path:
    model = {"model": str(tiny())}
    mooncake = {**model, "kv_backend": "mooncake"}
    deployment = Deployment(
        name="tp-pd", entry_model="pd_ensemble", models=TRITON_MODELS,
        overrides={"pd_ensemble": {"prefill_models": "prefill", "decode_models": "decode"},
                   "prefill": {**model, "tensor_parallel_size": "1"},
                   "decode": {**model, "tensor_parallel_size": "2"},
                   "pd_mooncake": {"prefill_models": "prefill_mooncake", "decode_models": "decode_mooncake"},
                   "prefill_mooncake": {**mooncake, "tensor_parallel_size": "2"},
                   "decode_mooncake": {**mooncake, "tensor_parallel_size": "1"}},
        copies={"pd_mooncake": "pd_ensemble", "prefill_mooncake": "prefill", "decode_mooncake": "decode"})
    return build_model_repository(deployment, tmp_dir)


def test_prefill_tp1_to_decode_tp2_over_nixl_streams_equal_colocated_tp1(triton_server) -> None:
    # two rank processes in the server: decode's rank 1 and prefill_mooncake's
    check_streams_equal_colocated_tp1(triton_server, rank_processes=2)


def test_prefill_tp2_to_decode_tp1_over_mooncake_streams_equal_colocated_tp1(triton_server) -> None:
    check_streams_equal_colocated_tp1(triton_server, router="pd_mooncake", prefill="prefill_mooncake",
                                      rank_processes=2)
