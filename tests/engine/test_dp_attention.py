"""DP attention inside one engine (``enable_dp_attention``, docs/parallelism.md): each of N ranks runs
attention on its own requests over its own KV pool, dense MLPs split by columns over every rank's tokens, MoE
layers expert-parallel. Models: the tiny random DeepSeek-V3 and Qwen3-MoE of ``test_moe_models`` and a tiny
random Llama with 6 attention heads over 3 KV heads (``test_tensor_parallel``), fp32.

Invariants: the DP step message carries each rank's batch, an empty one included; a request's greedy tokens
equal the single-rank engine's (logprobs within 1e-4) whichever rank serves it and whatever runs on the other
rank, or with the other rank idle; each rank's pool has its own page ids, all back after the requests end;
under 32 concurrent requests the ranks' computed tokens and requests stay within 1.5x of each other (the
engine's per-rank counters); a request that names its rank runs there, one naming a rank the engine lacks is
refused; a rank killed with kill -9 mid-step fails that step within seconds naming it,
and every later step and request; a rank that hangs fails the step after ``tp_timeout_s``; a bad
configuration is refused by name.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import RequestRejected, TensorParallelError
from engine.forward_batch import ForwardBatch
from engine.parallel.step import decode_dp_step, encode_dp_step
from tests.engine.test_expert_parallel import assert_a_killed_rank_fails_the_step
from tests.engine.test_moe_models import deepseek_config, qwen3_moe_config, save_model
from tests.engine.test_tensor_parallel import SHAPE_6_3, _alive, _children, greedy_outputs, needs_model

pytestmark = [pytest.mark.reference, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

PROMPTS = [[7], [3, 17, 60, 5, 9], list(range(20, 33)), [(11 * i + 5) % 128 for i in range(29)]]
FILLER = [(5 * i + 3) % 128 for i in range(40)]   # a long request that keeps rank 0 the busier one
MAX_TOKENS = 10


def _empty_batch() -> ForwardBatch:
    none = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(none, none, none, [], [], [], none)


def test_the_dp_step_message_gives_each_rank_its_batch_and_every_ranks_counts() -> None:
    busy = ForwardBatch(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 4]), torch.tensor([4, 5, 13]), [2, 1],
                        [2, 5], [[1], [2, 3]], torch.tensor([1, 2]))
    message = encode_dp_step([_empty_batch(), busy])
    idle = decode_dp_step(message, 0, torch.device("cpu"))
    assert idle.num_tokens == 0 and idle.num_seqs == 0
    assert idle.dp is not None and idle.dp.token_counts == (0, 3) and idle.dp.logits_counts == (0, 2)
    mine = decode_dp_step(message, 1, torch.device("cpu"))
    assert torch.equal(mine.input_ids, busy.input_ids) and mine.page_tables == busy.page_tables
    assert mine.dp is not None and mine.dp.token_rows == range(3) and mine.dp.logits_rows == range(2)
    with pytest.raises(ValueError):
        decode_dp_step(message, 2, torch.device("cpu"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dp-models") / "deepseek_v3"
    save_model(folder, deepseek_config())
    return folder


def make_engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_pages=96, page_size=4, chunk_size=16,
                                  max_num_batched_tokens=32, **kw))


@pytest.fixture(scope="module")
def dp_deepseek(deepseek: Path) -> Iterator[LLMEngine]:
    # no prefix cache: these tests place requests by load alone (a cached prefix draws its prompt back)
    engine = make_engine(deepseek, expert_parallel_size=2, enable_dp_attention=True,
                         enable_prefix_caching=False)
    try:
        yield engine
    finally:
        engine.close()


Run = dict[str, tuple[list[int], list[float]]]


def run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = MAX_TOKENS,
        ranks: dict[str, int] | None = None) -> Run:
    """Greedy outputs of ``prompts`` run together; ``ranks`` gets each request's DP rank."""
    return greedy_outputs(engine, prompts, max_tokens, ranks)


def assert_same(reference: tuple[list[int], list[float]], got: tuple[list[int], list[float]],
                what: str) -> None:
    assert got[0] == reference[0], what
    assert torch.allclose(torch.tensor(got[1]), torch.tensor(reference[1]), atol=1e-4, rtol=0), what


def test_deepseek_v3_tokens_are_the_single_rank_engines_on_either_rank_alone_or_beside_others(
        deepseek: Path, dp_deepseek: LLMEngine) -> None:
    one = make_engine(deepseek)
    try:
        reference = run(one, {str(i): p for i, p in enumerate(PROMPTS)})
        filler_ref = run(one, {"filler": FILLER}, max_tokens=30)["filler"]
    finally:
        one.close()
    assert len({tuple(t) for t, _ in reference.values()}) == len(PROMPTS)   # the prompts' texts differ
    engine = dp_deepseek
    assert engine.num_total_pages == 2 * 96 and engine.kv_pool.num_pages == 96
    rank0 = engine.parallel.loaded.model
    assert rank0.layers[0].attn.num_heads == 4                     # every head on every rank
    assert list(rank0.layers[1].ffn.dispatcher.local_experts) == [0, 1, 2, 3]
    ranks: dict[str, int] = {}
    together = run(engine, {str(i): p for i, p in enumerate(PROMPTS)}, ranks=ranks)
    assert set(ranks.values()) == {0, 1}
    for rid in reference:
        assert_same(reference[rid], together[rid], f"request {rid} with the others, on rank {ranks[rid]}")
    for rid, prompt in enumerate(PROMPTS):   # alone: rank 0, rank 1 idle
        where: dict[str, int] = {}
        alone = run(engine, {str(rid): prompt}, ranks=where)
        assert where == {str(rid): 0}
        assert_same(reference[str(rid)], alone[str(rid)], f"request {rid} alone on rank 0")
    for rid, prompt in enumerate(PROMPTS):   # on rank 1 while rank 0 runs the filler
        where = {}
        got = run(engine, {"filler": FILLER, str(rid): prompt}, max_tokens=30, ranks=where)
        assert where == {"filler": 0, str(rid): 1}
        assert_same(reference[str(rid)], (got[str(rid)][0][:MAX_TOKENS], got[str(rid)][1][:MAX_TOKENS]),
                    f"request {rid} on rank 1 beside the filler")
        assert_same(filler_ref, got["filler"], "the filler on rank 0")


def test_32_concurrent_requests_keep_the_ranks_loads_within_1_5x(dp_deepseek: LLMEngine) -> None:
    engine = dp_deepseek
    before = [(load.requests, load.tokens) for load in engine.dp_loads]
    gen = torch.Generator().manual_seed(7)
    prompts = {f"r{i}": torch.randint(3, 128, (int(torch.randint(1, 30, (1,), generator=gen)),),
                                      generator=gen).tolist() for i in range(32)}
    lengths = {rid: 2 + i % 7 for i, rid in enumerate(prompts)}   # 2..8 new tokens
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=lengths[rid], temperature=0.0,
                                                       ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_pages == engine.num_total_pages
    requests = [load.requests - b[0] for load, b in zip(engine.dp_loads, before)]
    tokens = [load.tokens - b[1] for load, b in zip(engine.dp_loads, before)]
    assert sum(requests) == 32
    assert sum(tokens) == sum(len(p) + lengths[rid] - 1 for rid, p in prompts.items())
    assert max(tokens) <= 1.5 * min(tokens), tokens
    assert max(requests) <= 1.5 * min(requests), requests


def test_a_request_runs_on_the_rank_it_names_and_a_rank_the_engine_lacks_is_refused_by_name(
        dp_deepseek: LLMEngine) -> None:
    """What a PD router's ``dp_rank`` becomes: the engine runs the request on that rank (an idle engine would
    place it on rank 0) with the tokens it gives there by itself; a rank outside 0..N-1 is a rejection
    naming it, and nothing is left behind."""
    engine = dp_deepseek
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("named", PROMPTS[1], params, dp_rank=1)
    assert engine.dp_rank_of("named") == 1
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert engine.dp_rank_of("named") is None and engine.num_free_pages == engine.num_total_pages
    where: dict[str, int] = {}
    assert tokens == run(engine, {"placed": PROMPTS[1]}, ranks=where)["placed"][0] and where == {"placed": 0}
    for bad in (2, -1):
        with pytest.raises(RequestRejected, match=rf"dp_rank {bad} is not a DP-attention rank .*0\.\.1"):
            engine.add_request(f"bad{bad}", PROMPTS[0], params, dp_rank=bad)
    assert not engine.has_unfinished() and engine.num_free_pages == engine.num_total_pages


def test_a_prompt_goes_back_to_the_rank_caching_its_prefix_unless_that_rank_is_busier_than_it_saves(
        deepseek: Path) -> None:
    engine = make_engine(deepseek, expert_parallel_size=2, enable_dp_attention=True)
    prefix = [(3 * i + 2) % 128 for i in range(32)]   # 8 whole pages of 4
    try:
        ranks: dict[str, int] = {}
        run(engine, {"first": prefix + [5]}, max_tokens=4, ranks=ranks)     # idle engine: rank 0
        run(engine, {"other": [9] * 12}, max_tokens=4, ranks=ranks)        # idle again: rank 0 too
        hits = engine.prefix_cache_stats().hits_tokens
        # rank 0 busy with 14 tokens to compute, which is less than the 32 cached there: back to rank 0
        run(engine, {"short": [7, 7], "again": prefix + [6]}, max_tokens=12, ranks=ranks)
        assert ranks["short"] == 0 and ranks["again"] == 0
        assert engine.prefix_cache_stats().hits_tokens - hits == 32
        # rank 0 busy with more than 32 tokens to compute: the prompt goes to the idle rank 1
        run(engine, {"long": [11] * 40, "third": prefix + [8]}, max_tokens=12, ranks=ranks)
        assert ranks["long"] == 0 and ranks["third"] == 1
    finally:
        engine.close()


def test_qwen3_moe_gives_the_single_rank_tokens_with_its_kv_heads_whole_on_each_rank(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("dp-qwen") / "qwen3_moe"
    save_model(folder, qwen3_moe_config())
    prompts = {str(i): p for i, p in enumerate(PROMPTS)}
    one = make_engine(folder)
    try:
        reference = run(one, prompts)
    finally:
        one.close()
    engine = make_engine(folder, expert_parallel_size=2, enable_dp_attention=True)
    try:
        assert engine.kv_pool.shape.num_kv_heads == 2   # every KV head of the model, in every rank's pool
        ranks: dict[str, int] = {}
        got = run(engine, prompts, ranks=ranks)
    finally:
        engine.close()
    assert set(ranks.values()) == {0, 1}
    for rid in reference:
        assert_same(reference[rid], got[rid], f"request {rid} on rank {ranks[rid]}")


@needs_model
def test_a_dense_llama_runs_its_mlp_split_and_gives_the_single_rank_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from perf.tiny_model import build_random_llama

    folder = build_random_llama(tmp_path_factory.mktemp("dp-llama") / "6x3", 0, SHAPE_6_3, "dp-6x3", std=0.2)
    prompts = {str(i): p for i, p in enumerate([[1, 2, 3, 4, 5], list(range(100, 141)), [7] * 9])}
    one = make_engine(folder)
    try:
        reference = run(one, prompts)
    finally:
        one.close()
    engine = make_engine(folder, tensor_parallel_size=2, enable_dp_attention=True)
    try:
        layer = engine.parallel.loaded.model.layers[0]
        assert layer.num_heads == 6 and layer.num_kv_heads == 3 and layer.down_proj.shape == (64, 48)
        ranks: dict[str, int] = {}
        got = run(engine, prompts, ranks=ranks)
    finally:
        engine.close()
    assert set(ranks.values()) == {0, 1}
    for rid in reference:
        assert_same(reference[rid], got[rid], f"request {rid} on rank {ranks[rid]}")


def test_rank_1_killed_mid_step_fails_the_step_naming_it_and_everything_after(deepseek: Path) -> None:
    engine = make_engine(deepseek, expert_parallel_size=2, enable_dp_attention=True, tp_timeout_s=30.0)
    try:
        pid = assert_a_killed_rank_fails_the_step(engine)
        with pytest.raises(TensorParallelError, match="killed by signal 9"):
            engine.add_request("c", PROMPTS[0], SamplingParams(max_tokens=4))
    finally:
        engine.close()
    assert not _alive(pid)


def test_a_hung_rank_fails_the_step_after_tp_timeout_s(deepseek: Path) -> None:
    engine = make_engine(deepseek, expert_parallel_size=2, enable_dp_attention=True, tp_timeout_s=1.0)
    pid = engine.parallel.rank_pids[0]
    try:
        engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0))
        engine.step()
        os.kill(pid, signal.SIGSTOP)   # rank 1 is idle (one request, on rank 0): its empty batch never comes
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            engine.step()
        assert 0.9 < time.monotonic() - start < 10.0   # seconds, never a hang (on a loaded host)
    finally:
        engine.close()
    assert not _alive(pid)


def test_a_bad_configuration_is_refused_by_name(deepseek: Path) -> None:
    from serving.config import ConfigError, WorkerConfig

    with pytest.raises(ValueError, match="enable_dp_attention needs ranks"):
        EngineConfig(enable_dp_attention=True)
    with pytest.raises(ConfigError, match="enable_dp_attention"):
        WorkerConfig(enable_dp_attention=True)
    dp = WorkerConfig(model=str(deepseek), expert_parallel_size=2, enable_dp_attention=True)
    assert dp.engine_config("decode").dp_size == 2
    before = _children()
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide"):
        make_engine(deepseek, expert_parallel_size=3, enable_dp_attention=True)
    assert _children() == before
