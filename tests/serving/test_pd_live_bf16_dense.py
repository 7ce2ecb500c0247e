"""``pd_ensemble`` with ``dtype: bfloat16`` and dense weights (``weight_quant: none``) on both prefill and
decode: on a CPU with AVX512_BF16 and no AMX the weights are prepacked for oneDNN (``PackedBF16Weight``), and
the streams equal a colocated engine of the same format run in-process, one request at a time (as in
``test_pd_live_bf16.py``, whose repository helper this module shares)."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import PROMPTS, colocated_greedy_texts
from test_pd_live_bf16 import GREEDY, TRITON_MODELS, repository_in_format  # noqa: F401 (fixture reads it)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
FORMAT = {"dtype": "bfloat16", "weight_quant": "none"}


def make_model_repository(tmp_dir: Path) -> Path:
    return repository_in_format(tmp_dir, FORMAT)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, **FORMAT)


def test_bf16_dense_streams_equal_the_colocated_engine(triton_server, reference) -> None:
    def generate(prompt: str):
        return grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")

    for prompt in PROMPTS:
        streams_match_reference(generate, [prompt], reference)
    assert metric_value(triton_server.metrics_url, "pd_kv_transfer_bytes_total", model="prefill") > 0
