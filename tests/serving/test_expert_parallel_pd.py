"""PD between prefill and decode instances of different expert-parallel sizes, without Triton: the router's
orchestrator -> prefill worker (EP=a) + decode worker (EP=b), real engines on the tiny random DeepSeek-V3 of
``test_moe_pd_workers`` (MLA: every rank of an EP=2 instance holds the whole latent), in-process KV transfer.

Invariants: with P EP=2 -> D EP=1 and P EP=1 -> D EP=2 the merged greedy stream equals a colocated EP=1
engine's, so with D EP=2 the latent reached both decode ranks' pools; the prefill side moves the latent of
each prompt token once per decode rank (P EP=2: from one of its two replicas only; D EP=2: into each of the
decode ranks' replicas, as a TP decode instance with a replicated KV head gets it); every page of both
instances returns. The ``expert_parallel_size`` model parameter reaches the engine's config; a bad value, one
given with ``tensor_parallel_size``, one on a GPU for prefill/decode, and one that does not divide the
experts (at load) are refused naming it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_moe_pd_workers import colocated_text, save_tiny_deepseek
from test_pd_workers import Cluster, request

from serving.config import WorkerConfig
from serving.workers.pd_factory import create_pd_worker

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

PROMPTS = ["t3 t17 t60 t5 t9", " ".join(f"t{(7 * i + 3) % 128}" for i in range(37))]
#: fp32 latent (kv_lora_rank 16 + rope 8) of the 3 layers, per token
LATENT_TOKEN_BYTES = 3 * 24 * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_deepseek(tmp_path_factory.mktemp("ep-pd"))


@pytest.fixture
def cluster(sizes: tuple[int, int], folder: Path) -> Iterator[Cluster]:
    prefill_ep, decode_ep = sizes
    config = WorkerConfig(model=str(folder), page_size=4, num_pages=64, chunk_size=8,
                          max_num_batched_tokens=16,
                          kv_backend="inprocess", bootstrap_timeout_s=5.0, waiting_timeout_s=5.0)
    ids = (f"prefill-ep{prefill_ep}@127.0.0.1:1", f"decode-ep{decode_ep}@127.0.0.1:1")
    prefill = create_pd_worker("prefill", replace(config, expert_parallel_size=prefill_ep), ids[0])
    decode = create_pd_worker("decode", replace(config, expert_parallel_size=decode_ep), ids[1])
    prefill.start()
    decode.start()
    yield Cluster(prefill, decode, ids)
    decode.stop()
    prefill.stop()


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=lambda p: f"P{p[0]}-D{p[1]}")
def test_greedy_streams_equal_colocated_ep1_and_the_latent_moves_once_per_decode_rank(
        sizes: tuple[int, int], cluster: Cluster, folder: Path) -> None:
    start = cluster.free_pages()
    tokenizer = cluster.prefill.loop.engine.tokenizer
    for prompt in PROMPTS:
        before = cluster.prefill.kv_manager.metrics()["kv_bytes_total"]
        deltas = cluster.generate(request(prompt, max_tokens=20, ignore_eos=True))
        assert not [d.error for d in deltas if d.error], deltas
        assert "".join(d.text for d in deltas) == colocated_text(folder, prompt), prompt
        moved = cluster.prefill.kv_manager.metrics()["kv_bytes_total"] - before
        assert moved == len(tokenizer.encode(prompt)) * LATENT_TOKEN_BYTES * sizes[1]
    assert cluster.wait_free(start) == start


def test_the_parameter_reaches_the_engine_config_and_bad_values_are_refused_by_name() -> None:
    from serving.config import ConfigError, build_worker_config

    assert WorkerConfig().engine_config("prefill").expert_parallel_size == 1
    config = build_worker_config({"expert_parallel_size": {"string_value": "2"}}, environ={})
    assert config.engine_config("prefill").expert_parallel_size == 2
    for params in ({"expert_parallel_size": "0"}, {"expert_parallel_size": "two"},
                   {"expert_parallel_size": "2", "tensor_parallel_size": "2"}):
        with pytest.raises(ConfigError) as info:
            build_worker_config(params, environ={})
        assert info.value.param == "expert_parallel_size", params
    with pytest.raises(ConfigError) as info:
        create_pd_worker("prefill", WorkerConfig(expert_parallel_size=2, device="cuda:0"), "i")
    assert info.value.param == "expert_parallel_size"


def test_a_size_that_does_not_divide_the_experts_fails_the_load_naming_it(folder: Path) -> None:
    from serving.workers.colocated import ColocatedWorker

    match = "expert_parallel_size=3 does not divide the model's 8 routed experts"
    with pytest.raises(ValueError, match=match):
        ColocatedWorker.create(WorkerConfig(model=str(folder), num_pages=8, expert_parallel_size=3))
