"""``pd_ensemble`` with ``dtype: bfloat16`` and ``weight_quant: int8`` on both prefill and decode: the KV
crosses in bf16 (half of fp32's bytes per page) and the streams equal a colocated engine of the same format
run in-process, i.e. prefill and decode run the same kernels as colocated.

One request at a time, against a reference run one prompt at a time: in this format a batch of up to 16 rows
runs on the AVX2 kernels and a larger one on torch's BLAS (``engine.model.linear``), so a prompt's numbers,
and greedy text at a near tie, depend on which prompts shared its steps; concurrent parity is fp32's test
(``test_pd_live.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import PROMPTS, colocated_greedy_texts

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
TRITON_MODELS = ("pd_ensemble", "prefill", "decode")
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
FORMAT = {"dtype": "bfloat16", "weight_quant": "int8"}
SHIPPED = {"dtype": "float32", "weight_quant": "none"}  # the values in model_repository
GREEDY = {"max_tokens": "16", "temperature": "0"}


def make_model_repository(tmp_dir: Path) -> Path:
    """model_repository with prefill and decode switched from ``SHIPPED`` to ``FORMAT``."""
    return repository_in_format(tmp_dir, FORMAT)


def repository_in_format(tmp_dir: Path, fmt: dict[str, str]) -> Path:
    """``TRITON_MODELS`` of model_repository copied into ``tmp_dir``, prefill and decode switched from
    ``SHIPPED`` to ``fmt`` (also used by ``test_pd_live_bf16_dense.py``)."""
    for name in TRITON_MODELS:
        shutil.copytree(REPOSITORY / name, tmp_dir / name)
    for role in ("prefill", "decode"):
        path = tmp_dir / role / "config.pbtxt"
        text = path.read_text()
        for key, value in fmt.items():
            shipped = f'{{ key: "{key}", value: {{ string_value: "{SHIPPED[key]}" }} }}'
            assert shipped in text, (path, shipped)
            text = text.replace(shipped, shipped.replace(f'"{SHIPPED[key]}"', f'"{value}"'))
        path.write_text(text)
    return tmp_dir


def check_streams_equal_colocated_and_kv_crosses(server, fmt: dict[str, str]) -> None:
    """Each prompt of ``PROMPTS`` through ``server``'s ``pd_ensemble`` streams the greedy text of a colocated
    engine of format ``fmt`` run in-process one prompt at a time, and KV bytes crossed from prefill (also used
    by ``test_pd_live_bf16_dense.py``)."""
    reference = colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, **fmt)

    def generate(prompt: str):
        return grpc_generate(server.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")

    for prompt in PROMPTS:
        streams_match_reference(generate, [prompt], reference)
    assert metric_value(server.metrics_url, "pd_kv_transfer_bytes_total", model="prefill") > 0


def test_bf16_int8_streams_equal_the_colocated_engine_and_kv_crosses(triton_server) -> None:
    check_streams_equal_colocated_and_kv_crosses(triton_server, FORMAT)
