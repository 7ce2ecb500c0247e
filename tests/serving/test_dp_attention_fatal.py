"""A DP-attention instance whose rank dies ends its requests through the engine loop's dead-rank path (issue
#47 item 4; the TP/EP path of docs/parallelism.md, "Faults"): a real engine of 2 DP ranks (the tiny random
DeepSeek-V3 of ``tests/engine/test_moe_models``, fp32) under ``EngineLoop``, requests on both ranks.

Invariant: kill -9 of rank 1 while both ranks decode fails every request within 5 s with an error naming the
rank, then calls ``on_fatal`` once with the ``TensorParallelError`` (inside tritonserver that is
``serving.workers.fatal.exit_process_soon``); no step waits forever, every page is back, no rank process is
left after ``close``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineError, TensorParallelError
from serving.events import LoopEvent, RequestFailed
from serving.workers.engine_loop import EngineLoop
from tests.engine.test_moe_models import deepseek_config, save_model
from tests.engine.test_tensor_parallel import _alive

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]


def test_a_dead_dp_rank_fails_every_request_naming_it_then_calls_on_fatal_once(tmp_path: Path) -> None:
    save_model(tmp_path / "deepseek_v3", deepseek_config())
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "deepseek_v3"), num_pages=128, page_size=4,
                                    expert_parallel_size=2, enable_dp_attention=True, tp_timeout_s=30.0))
    pid = engine.parallel.rank_pids[0]
    events: dict[str, list[LoopEvent]] = {rid: [] for rid in ("a", "b", "c", "d")}
    fatal: list[EngineError] = []
    called = threading.Event()

    def on_fatal(error: EngineError) -> None:
        fatal.append(error)
        called.set()

    loop = EngineLoop(engine, name="dp-fatal-loop", idle_wait_s=0.02, on_fatal=on_fatal)
    loop.start()
    try:
        for i, rid in enumerate(events):
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            loop.submit(rid, [3 + i, 17, 60], params, events[rid].append)
        deadline = time.monotonic() + 30
        while not all(events.values()) and time.monotonic() < deadline:   # every request has decoded
            time.sleep(0.01)
        assert all(events.values()), "the requests did not start"
        assert {engine.scheduler.rank_of(rid) for rid in events} == {0, 1}
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert called.wait(5), "on_fatal was not called"
        for rid, got in events.items():
            assert isinstance(got[-1], RequestFailed), rid
            assert f"rank 1 (pid {pid}) was killed by signal 9" in str(got[-1].error), rid
        assert time.monotonic() - killed_at < 5
        time.sleep(0.2)
        assert len(fatal) == 1 and isinstance(fatal[0], TensorParallelError)
    finally:
        assert loop.stop(10)
        engine.close()
    assert engine.num_free_pages == engine.num_total_pages
    assert not _alive(pid)
