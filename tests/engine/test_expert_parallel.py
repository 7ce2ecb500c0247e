"""Expert parallelism inside one engine (``expert_parallel_size``, docs/moe.md): tiny random DeepSeek-V3 and
Qwen3-MoE models made with transformers' configs (8 experts, top-2, one dense layer first; fp32).

Invariants: an EP=2 engine gives EP=1's greedy tokens with logprobs within 1e-4, each rank holding 4 of the 8
experts and half of the attention heads (MLA: every rank the whole latent KV; GQA: its KV head); a size the
model cannot take fails the engine naming ``expert_parallel_size`` and starts no rank process; a rank killed
with kill -9 in the middle of a step fails that step within seconds with an error naming it, every later step
too, all pages back and no rank process left; a rank that hangs fails the step after ``tp_timeout_s``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import TensorParallelError
from engine.model.moe_dispatch import AllToAllDispatcher
from engine.model.shm_dispatch import SharedMemoryDispatcher
from tests.engine.test_moe_models import deepseek_config, qwen3_moe_config, save_model
from tests.engine.test_tensor_parallel import _alive, _children, greedy_outputs

pytestmark = [pytest.mark.reference, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

PROMPTS = [[7], [3, 17, 60, 5, 9], list(range(20, 33)), [(11 * i + 5) % 128 for i in range(29)]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ep-models")
    save_model(base / "deepseek_v3", deepseek_config())
    save_model(base / "qwen3_moe", qwen3_moe_config())
    return {"deepseek_v3": base / "deepseek_v3", "qwen3_moe": base / "qwen3_moe"}


def make_engine(folder: Path, ep: int, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_pages=96, page_size=4, chunk_size=16,
                                  max_num_batched_tokens=32, expert_parallel_size=ep, **kw))


def greedy(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    return greedy_outputs(engine, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("arch,dispatcher", [("deepseek_v3", "auto"), ("qwen3_moe", "auto"),
                                             ("deepseek_v3", "all_to_all")])
def test_ep2_gives_ep1s_greedy_tokens_with_half_the_experts_and_heads_per_rank(
        models: dict[str, Path], arch: str, dispatcher: str) -> None:
    """``moe_dispatcher`` "auto" on CPU ranks: the shared-memory exchange; "all_to_all": gloo's."""
    one = make_engine(models[arch], 1)
    try:
        reference = greedy(one)
    finally:
        one.close()
    assert len({tuple(t) for t, _ in reference.values()}) == len(PROMPTS)   # the prompts' texts differ
    two = make_engine(models[arch], 2, moe_dispatcher=dispatcher)
    try:
        assert two.parallel is not None and len(two.parallel.rank_pids) == 1
        rank0 = two.parallel.loaded.model
        moe_layer = rank0.layers[1].ffn
        assert list(moe_layer.dispatcher.local_experts) == [0, 1, 2, 3] and moe_layer.w13.shape[0] == 4
        expected = AllToAllDispatcher if dispatcher == "all_to_all" else SharedMemoryDispatcher
        assert type(moe_layer.dispatcher) is expected
        assert [s.num_heads for s in two.parallel.shards] == [2, 2]
        if arch == "deepseek_v3":   # one latent "head", on every rank
            assert two.kv_heads.replicas == 2 and two.kv_pool.shape.kind == "mla"
        else:
            assert two.kv_heads.num_heads == 1 and two.kv_heads.replicas == 1
        got = greedy(two)
    finally:
        two.close()
    for rid, (tokens, logprobs) in reference.items():
        assert got[rid][0] == tokens, rid
        assert torch.allclose(torch.tensor(got[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0), rid


@pytest.mark.parametrize("ep,words", [(3, "does not divide the model's 8 routed experts"),
                                      (8, "does not fit the model's 4 attention heads")])
def test_a_size_the_model_cannot_take_fails_naming_expert_parallel_size_and_starts_no_rank(
        models: dict[str, Path], ep: int, words: str) -> None:
    before = _children()
    with pytest.raises(ValueError, match=f"expert_parallel_size={ep} {words}"):
        make_engine(models["deepseek_v3"], ep)
    assert _children() == before


def test_expert_parallel_with_tensor_parallel_or_on_a_dense_model_is_refused_by_name(
        models: dict[str, Path]) -> None:
    from engine.model.hf_folder import read_hf_config
    from engine.model.moe_lm import check_expert_parallel_size
    from serving.config import ConfigError, WorkerConfig

    with pytest.raises(ValueError, match="expert_parallel_size=2 with tensor_parallel_size=2"):
        EngineConfig(expert_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size must be a positive int"):
        EngineConfig(expert_parallel_size=0)
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        WorkerConfig(expert_parallel_size=2, tensor_parallel_size=2)
    dense = replace(read_hf_config(models["qwen3_moe"] / "config.json", "qwen3"), moe=None)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        check_expert_parallel_size(dense, 2)


def test_moe_dispatcher_shm_is_refused_by_name_where_it_cannot_run_and_auto_falls_back(
        models: dict[str, Path]) -> None:
    """Without shared-memory collectives, or when one step's exchange would exceed ``MOE_SHM_SLOT_CAP``:
    "shm" fails the start naming the field and the cause; "auto" takes the all-to-all."""
    from engine.model.hf_folder import read_hf_config
    from engine.parallel.group import MOE_SHM_SLOT_CAP, _moe_exchange

    mc = read_hf_config(models["deepseek_v3"] / "config.json", "deepseek_v3")
    assert mc.moe is not None
    config = EngineConfig(expert_parallel_size=2, max_num_batched_tokens=32)
    assert _moe_exchange(config, mc, "shm") == "shm"
    assert _moe_exchange(config, mc, "torch") == "all_to_all"
    assert _moe_exchange(replace(config, moe_dispatcher="all_to_all"), mc, "shm") == "all_to_all"
    with pytest.raises(ValueError, match="moe_dispatcher='shm' cannot be used: the ranks' collectives"):
        _moe_exchange(replace(config, moe_dispatcher="shm"), mc, "torch")
    row = mc.moe.top_k * mc.hidden_size * 4
    huge = replace(config, max_num_batched_tokens=MOE_SHM_SLOT_CAP // row + 1)
    assert _moe_exchange(huge, mc, "shm") == "all_to_all"
    with pytest.raises(ValueError, match="over MOE_SHM_SLOT_CAP .*lower max_num_batched_tokens"):
        _moe_exchange(replace(huge, moe_dispatcher="shm"), mc, "shm")
    with pytest.raises(ValueError, match="moe_dispatcher must be one of"):
        EngineConfig(moe_dispatcher="deepep")
    assert _moe_exchange(EngineConfig(), mc, "shm") == "all_to_all"   # not expert-parallel


def assert_a_killed_rank_fails_the_step(engine: LLMEngine) -> int:
    """Two greedy requests stepped 3 times; rank 1 stopped (SIGSTOP) so that the next step blocks inside one
    of its exchanges, then killed: that step fails within 3 s naming rank 1, the next one too, and once the
    requests are aborted (what the serving loop does) every page is free. Returns rank 1's pid."""
    pid = engine.parallel.rank_pids[0]
    for rid in ("a", "b"):   # with DP attention: one per rank
        engine.add_request(rid, PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGSTOP)   # rank 1 stops where it is, so the next step blocks on it
    failed: list[tuple[float, BaseException]] = []

    def step() -> None:
        try:
            engine.step()
        except TensorParallelError as e:
            failed.append((time.monotonic(), e))

    stepping = threading.Thread(target=step)
    stepping.start()
    time.sleep(0.3)                 # rank 0 now waits inside an exchange of that step
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    stepping.join(10)
    assert not stepping.is_alive() and failed, "the step did not fail"
    assert failed[0][0] - killed_at < 10.0   # within seconds (a loaded host is slow)
    assert f"rank 1 (pid {pid}) was killed by signal 9" in str(failed[0][1])
    with pytest.raises(TensorParallelError, match="killed by signal 9"):
        engine.step()
    for rid in ("a", "b"):
        engine.abort_request(rid)
    assert engine.num_free_pages == engine.num_total_pages
    return pid


def test_rank_1_killed_mid_step_fails_that_step_naming_it_and_everything_after(
        models: dict[str, Path]) -> None:
    engine = make_engine(models["deepseek_v3"], 2, tp_timeout_s=30.0)   # the death is seen, not timed out
    try:
        pid = assert_a_killed_rank_fails_the_step(engine)
    finally:
        engine.close()
    assert not _alive(pid)


def test_a_hung_rank_fails_the_step_after_tp_timeout_s(models: dict[str, Path]) -> None:
    engine = make_engine(models["qwen3_moe"], 2, tp_timeout_s=1.0)
    pid = engine.parallel.rank_pids[0]
    try:
        engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            engine.step()
        assert 0.9 < time.monotonic() - start < 10.0   # seconds, never a hang (on a loaded host)
    finally:
        engine.close()
    assert not _alive(pid)
