"""``pd_ensemble`` in a real tritonserver with prefill at ``tensor_parallel_size`` 2 and decode at 1 (issue
#45 item 2), over NIXL, on a tiny random Llama with 4 attention heads over 2 KV heads (each prefill rank holds
one).

Invariants: the server runs one rank process (the TP=2 instance's rank 1); every stream equals a colocated
TP=1 engine's greedy text run in-process, so each decode token read the KV heads both prefill ranks
computed; KV bytes crossed from prefill.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import PROMPTS, colocated_greedy_texts

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]

TRITON_MODELS = ("pd_ensemble", "prefill", "decode")   # read by the triton_server fixture
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
GREEDY = {"max_tokens": "16", "temperature": "0"}
SHIPPED_MODEL = '{ key: "model", value: { string_value: "smollm2" } },'


@cache
def tiny() -> Path:
    """The random Llama, built once per test process outside the model repository."""
    root = Path(__file__).resolve().parents[2]
    if str(root / "scripts") not in sys.path:
        sys.path.insert(0, str(root / "scripts"))
    from perf.tiny_model import build_random_llama

    return build_random_llama(Path(tempfile.mkdtemp(prefix="tp-pd-live-")) / "tiny", 0, SHAPE, "tp-pd-live",
                              std=0.2)


def make_model_repository(tmp_dir: Path) -> Path:
    """model_repository's PD models, prefill and decode on the tiny model, prefill with 2 ranks."""
    return repository_with_ranks(tmp_dir, 2, 1)


def repository_with_ranks(tmp_dir: Path, prefill_tp: int, decode_tp: int) -> Path:
    """model_repository's PD models in ``tmp_dir``, prefill and decode on the tiny model with these
    ``tensor_parallel_size`` values (also used by ``test_tensor_parallel_pd_live_decode.py``)."""
    for name in TRITON_MODELS:
        shutil.copytree(REPOSITORY / name, tmp_dir / name)
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        path = tmp_dir / role / "config.pbtxt"
        text = path.read_text()
        assert SHIPPED_MODEL in text, path
        ours = (f'{{ key: "model", value: {{ string_value: "{tiny()}" }} }},\n'
                f'  {{ key: "tensor_parallel_size", value: {{ string_value: "{tp}" }} }},')
        path.write_text(text.replace(SHIPPED_MODEL, ours))
    return tmp_dir


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_prefill_tp2_to_decode_tp1_streams_equal_colocated_tp1(triton_server) -> None:
    check_streams_equal_colocated_tp1(triton_server)


def check_streams_equal_colocated_tp1(triton_server) -> None:  # noqa: ANN001
    """One rank process in the server; every stream of ``PROMPTS`` equals colocated TP=1's; KV crossed."""
    ranks = [pid for stub in triton_server.stub_pids() for pid in children(stub)
             if b"engine.parallel.rank_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 1, ranks
    reference = colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, model=str(tiny()))
    assert len(set(reference.values())) > 1

    def generate(prompt: str):  # noqa: ANN202
        return grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")

    for prompt in PROMPTS:
        streams_match_reference(generate, [prompt], reference)
    assert metric_value(triton_server.metrics_url, "pd_kv_transfer_bytes_total", model="prefill") > 0
