"""2P2D on one tritonserver: two prefill models (``prefill``, ``prefill_1``) and two decode models
(``decode``, ``decode_1``), behind one ``pd_ensemble`` that finds them in its own server's repository index
(no static list) and pairs them round robin.

Invariants: every request streams the colocated engine's greedy text whichever pair served it; both prefill
models and both decode models served requests; afterwards every pool is back at its size.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from live_client import metric_value, streams_match_reference
from test_pd_live import GREEDY, PROMPTS, generate, reference  # noqa: F401  (reference is a fixture)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
TRITON_MODELS = ("pd_ensemble", "prefill", "prefill_1", "decode", "decode_1")
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def make_model_repository(tmp_dir: Path) -> Path:
    """model_repository with a second prefill and a second decode model; pd_ensemble pairs round robin."""
    for name in ("pd_ensemble", "prefill", "decode"):
        shutil.copytree(REPOSITORY / name, tmp_dir / name)
    for role in ("prefill", "decode"):
        shutil.copytree(REPOSITORY / role, tmp_dir / f"{role}_1")
        _edit(tmp_dir / f"{role}_1" / "config.pbtxt", f'name: "{role}"', f'name: "{role}_1"')
    _edit(tmp_dir / "pd_ensemble" / "config.pbtxt", 'string_value: "cache_aware"',
          'string_value: "round_robin"')
    return tmp_dir


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new))


def test_2p2d_serves_every_pair_with_the_same_text(triton_server, reference) -> None:  # noqa: F811
    streams_match_reference(lambda p: generate(triton_server.grpc_url, p), PROMPTS, reference)
    url = triton_server.metrics_url
    served = {(m, i): metric_value(url, "pd_requests_total", model=m, instance=i, outcome="finished")
              for m, i in (("prefill", "prefill_0_0"), ("prefill_1", "prefill_1_0_0"),
                           ("decode", "decode_0_0"), ("decode_1", "decode_1_0_0"))}
    assert all(n >= 1 for n in served.values()), served
    assert served[("prefill", "prefill_0_0")] + served[("prefill_1", "prefill_1_0_0")] == len(PROMPTS)
    deadline = time.monotonic() + 30
    def pools_full() -> bool:
        return all(metric_value(url, "pd_kv_free_pages", model=m, instance=i)
                   == metric_value(url, "pd_kv_total_pages", model=m, instance=i)
                   for m, i in served)
    while not pools_full() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pools_full()
