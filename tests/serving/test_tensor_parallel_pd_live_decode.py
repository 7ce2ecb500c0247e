"""``pd_ensemble`` in a real tritonserver with prefill at ``tensor_parallel_size`` 1 and decode at 2 (issue
#45 item 2), over NIXL, on the tiny random Llama of ``test_tensor_parallel_pd_live.py`` (whose helpers this
module shares): every stream equals a colocated TP=1 engine's greedy text, so each decode rank received its KV
head."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tensor_parallel_pd_live import (  # noqa: F401
    TRITON_MODELS,
    check_streams_equal_colocated_tp1,
    repository_with_ranks,
)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
# TRITON_MODELS above: read by the triton_server fixture


def make_model_repository(tmp_dir: Path) -> Path:
    return repository_with_ranks(tmp_dir, 1, 2)


def test_prefill_tp1_to_decode_tp2_streams_equal_colocated_tp1(triton_server) -> None:
    check_streams_equal_colocated_tp1(triton_server)
