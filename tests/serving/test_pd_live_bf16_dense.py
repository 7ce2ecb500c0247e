"""``pd_ensemble`` with ``dtype: bfloat16`` and dense weights (``weight_quant: none``) on both prefill and
decode: on a CPU with AVX512_BF16 and no AMX the weights are prepacked for oneDNN (``PackedBF16Weight``), and
the streams equal a colocated engine of the same format run in-process, one request at a time (as in
``test_pd_live_bf16.py``, whose helpers this module shares)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pd_live_bf16 import (  # noqa: F401
    TRITON_MODELS,
    check_streams_equal_colocated_and_kv_crosses,
    repository_in_format,
)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
# TRITON_MODELS above: read by the triton_server fixture
FORMAT = {"dtype": "bfloat16", "weight_quant": "none"}


def make_model_repository(tmp_dir: Path) -> Path:
    return repository_in_format(tmp_dir, FORMAT)


def test_bf16_dense_streams_equal_the_colocated_engine_and_kv_crosses(triton_server) -> None:
    check_streams_equal_colocated_and_kv_crosses(triton_server, FORMAT)
