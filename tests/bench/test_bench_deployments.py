"""Deployment definitions of scripts/perf/: config overrides, core pinning, headline figures. No server."""

from __future__ import annotations

from pathlib import Path

from perf.bench_run import BenchConfig, deployments_for, final_line
from perf.server import _override_parameters, host_state, log_excerpt

CONFIG = 'parameters [\n  { key: "num_threads", value: { string_value: "1" } }\n]\n'


def _cfg(models: tuple[str, ...]) -> BenchConfig:
    return BenchConfig.make(quick=True, models=models, concurrencies=None, slo_ttft_ms=None,
                            slo_itl_p99_ms=None,
                            colo_threads=2, port_base=18600, seed=0, out_json=Path("/tmp/x.json"),
                            plot_dir=Path("/tmp/p"), log_dir=Path("/tmp/l"))


def test_override_replaces_an_existing_parameter_and_appends_a_missing_one() -> None:
    out = _override_parameters(CONFIG, {"num_threads": "2", "chunk_size": "256"})
    assert 'key: "num_threads", value: { string_value: "2" }' in out
    assert '"1"' not in out
    assert 'parameters { key: "chunk_size", value: { string_value: "256" } }' in out


def test_pd_pins_prefill_and_decode_to_separate_cores_and_colocated_gets_both() -> None:
    pd, colo = deployments_for(_cfg(("pd_ensemble", "colocated")))
    assert pd.cpus == {"prefill": (0,), "decode": (1,)}
    assert colo.cpus == {"colocated": (0, 1)}
    assert colo.overrides["colocated"]["num_threads"] == "2"


def test_final_line_states_ratios_against_the_targets() -> None:
    results = {name: {"interference": {"decode": {"itl_p99_ms": itl, "ttft_p50_ms": 50.0},
                                       "long": {"ttft_p50_ms": ttft}}}
               for name, itl, ttft in (("pd", 100.0, 1200.0), ("colo", 400.0, 1000.0))}
    line = final_line(results)
    assert line["itl_p99_ratio_pd_over_colo"] == 0.25 and line["itl_target_met"] is True
    assert line["ttft_p50_ratio_pd_over_colo"] == 1.2 and line["ttft_target_met"] is True
    assert {"pd_itl_p99_ms", "colo_itl_p99_ms", "pd_ttft_p50_ms", "colo_ttft_p50_ms"} <= set(line)


def test_pd_hosts_is_the_pd_deployment_on_hosts_and_the_line_compares_it_with_one_host() -> None:
    pd, hosts = deployments_for(_cfg(("pd_ensemble", "pd_hosts")))
    assert (hosts.name, hosts.entry_model) == ("pd_hosts", "pd_ensemble")
    assert (hosts.models, hosts.overrides, hosts.cpus) == (pd.models, pd.overrides, pd.cpus)
    results = {name: {"interference": {"decode": {"itl_p99_ms": itl}, "long": {"ttft_p50_ms": ttft}},
                      "chat": {"1": {"ttft_p50_ms": chat}}}
               for name, itl, ttft,
               chat in (("pd", 100.0, 1000.0, 400.0), ("pd_hosts", 110.0, 1200.0, 500.0))}
    line = final_line(results)
    assert line["itl_p99_ratio_hosts_over_one_host"] == 1.1
    assert line["ttft_p50_ratio_hosts_over_one_host"] == 1.2
    assert line["chat_c1_ttft_p50_ratio_hosts_over_one_host"] == 1.25


def test_a_failed_start_keeps_a_crash_report_that_lies_before_the_tail() -> None:
    crash = ["Fatal Python error: Segmentation fault", "", "Thread 0x1 (most recent call first):",
             '  File "/x/engine/kv_pool.py", line 171 in populate']
    text = "\n".join(["loading"] * 50 + crash + [f"later line {i}" for i in range(400)]) + "\n"
    excerpt = log_excerpt(text, 200)
    assert excerpt.endswith(text[-200:])
    assert excerpt.startswith("[crash report earlier in the log]\nFatal Python error: Segmentation fault\n")
    assert 'line 171 in populate' in excerpt and "loading" not in excerpt
    # nothing to add
    assert log_excerpt("\n".join(["loading"] * 500), 100) == "\n".join(["loading"] * 500)[-100:]


def test_host_state_reads_this_host() -> None:
    state = host_state()
    assert state.startswith("[host] MemAvailable ") and " kB" in state and "tritonserver" in state
