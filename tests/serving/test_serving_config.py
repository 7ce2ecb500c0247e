"""``serving.config``: parameters as Triton passes them become one validated, frozen ``WorkerConfig``."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer.backends import BackendOptions
from kv_transfer.mooncake_transport import MooncakeOptions
from kv_transfer.nixl_transport import NixlOptions
from serving.config import ConfigError, WorkerConfig, build_worker_config


def _sv(**values: str) -> dict[str, dict[str, str]]:
    return {k: {"string_value": v} for k, v in values.items()}


def test_defaults_and_string_values() -> None:
    cfg = build_worker_config(_sv(page_size="32", num_pages="64", bootstrap_timeout_s="2.5"), environ={})
    assert (cfg.page_size, cfg.num_pages, cfg.bootstrap_timeout_s, cfg.chunk_size) == (32, 64, 2.5, 512)
    assert cfg.kv_cache_tokens == 32 * 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("params, param", [
    (_sv(page_size="sixteen"), "page_size"),
    (_sv(num_pages="0"), "num_pages"),
    (_sv(bogus="1"), "bogus"),
    (_sv(kv_backend="tcp"), "kv_backend"),
    (_sv(registry_url="127.0.0.1:8998"), "registry_url"),
    (_sv(rendezvous_port="70000"), "rendezvous_port"),
    (_sv(chunk_size="1024", max_num_batched_tokens="512"), "max_num_batched_tokens"),
    (_sv(waiting_timeout_s="-1"), "waiting_timeout_s"),
    (_sv(dtype="int8"), "dtype"),
    (_sv(weight_quant="int4"), "weight_quant"),
    (_sv(device="cuda:0"), "device"),
    (_sv(enable_prefix_caching="maybe"), "enable_prefix_caching"),
])
def test_bad_parameter_is_named(params: dict[str, dict[str, str]], param: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_worker_config(params, environ={})
    assert info.value.param == param


def test_environment_overrides_registry_url_and_carries_the_fleet_secret() -> None:
    cfg = build_worker_config({},
                              environ={"PD_REGISTRY_URL": "etcd://127.0.0.1:2379", "PD_FLEET_SECRET": "s3"})
    assert cfg.registry_url == "etcd://127.0.0.1:2379" and cfg.fleet_secret == b"s3"
    assert "s3" not in repr(cfg)   # never logged
    assert build_worker_config({}, environ={}).registry_url == ""   # no registry by default: plain Triton


def test_etcds_own_settings_come_from_the_environment_once_as_values() -> None:
    from serving.router.config import build_router_config

    env = {"PD_ETCD_USER": "u", "PD_ETCD_PASSWORD": "s3cret", "PD_ETCD_CA": "", "UNRELATED": "x"}
    want = {"PD_ETCD_USER": "u", "PD_ETCD_PASSWORD": "s3cret"}
    assert build_worker_config({}, environ=env).etcd_settings == want
    assert build_router_config({}, environ=env).etcd_settings == want
    assert "s3cret" not in repr(build_worker_config({}, environ=env))   # a password stays out of logs
    assert build_worker_config({}, environ={}).etcd_settings == {}


def test_kv_network_only_is_nixls_parameter_and_the_environment_overrides_it() -> None:
    assert build_worker_config({}, environ={}).kv_options == NixlOptions(network_only=False)
    assert (build_worker_config(_sv(kv_network_only="true"), environ={}).kv_options
            == NixlOptions(network_only=True))
    assert (build_worker_config({}, environ={"PD_KV_NETWORK_ONLY": "1"}).kv_options
            == NixlOptions(network_only=True))
    assert build_worker_config(_sv(kv_network_only="true"), environ={"PD_KV_NETWORK_ONLY": "0"}).kv_options \
        == NixlOptions(network_only=False)
    with pytest.raises(ConfigError) as info:
        build_worker_config({}, environ={"PD_KV_NETWORK_ONLY": "maybe"})
    assert info.value.param == "PD_KV_NETWORK_ONLY"


def test_nixls_progress_thread_is_a_parameter_and_the_environment_overrides_it() -> None:
    assert build_worker_config({}, environ={}).kv_options.progress_thread_ms == 5.0
    assert build_worker_config(_sv(kv_progress_thread_ms="2"), environ={}).kv_options \
        == NixlOptions(progress_thread_ms=2.0)
    assert build_worker_config(_sv(kv_progress_thread_ms="2"), environ={"PD_KV_PROGRESS_THREAD_MS": "0"}) \
        .kv_options == NixlOptions(progress_thread_ms=0.0)


def test_a_backends_options_come_from_its_own_parameters_and_others_are_ignored() -> None:
    """Each backend owns its options (``kv_transfer.backends``): Mooncake reads ``kv_protocol``/``kv_device``
    and refuses a protocol it does not run, naming the parameter; NIXL's ``kv_network_only`` (parameter or
    environment) is ignored under Mooncake, and Mooncake's parameters under NIXL; an unknown ``kv_*`` name is
    still an unknown parameter."""
    cfg = build_worker_config(_sv(kv_backend="mooncake", kv_protocol="rdma", kv_device="mlx5_0,mlx5_1",
                                  kv_network_only="true"), environ={"PD_KV_NETWORK_ONLY": "1"})
    assert cfg.kv_options == MooncakeOptions(protocol="rdma", device="mlx5_0,mlx5_1")
    assert build_worker_config(_sv(kv_protocol="rdma"), environ={}).kv_options == NixlOptions()
    assert build_worker_config(_sv(kv_backend="inprocess"), environ={}).kv_options == BackendOptions()
    for params, param in ((_sv(kv_backend="mooncake", kv_protocol="udp"), "kv_protocol"),
                          (_sv(kv_network_only="maybe"), "kv_network_only"),
                          (_sv(kv_progress_thread_ms="-1"), "kv_progress_thread_ms"),
                          (_sv(kv_bogus="1"), "kv_bogus")):
        with pytest.raises(ConfigError) as info:
            build_worker_config(params, environ={})
        assert info.value.param == param
    with pytest.raises(ConfigError, match="takes MooncakeOptions"):
        WorkerConfig(kv_backend="mooncake", kv_options=NixlOptions())


def test_engine_config_carries_the_knobs() -> None:
    ec = WorkerConfig(page_size=8, num_pages=10, chunk_size=64,
                      max_num_batched_tokens=128).engine_config("decode")
    assert (ec.mode, ec.page_size, ec.num_pages, ec.chunk_size, ec.max_num_batched_tokens) == \
        ("decode", 8, 10, 64, 128)


def test_prefix_caching_is_on_by_default_and_a_parameter_turns_it_off() -> None:
    assert build_worker_config({}, environ={}).engine_config("colocated").prefix_caching_active
    for text in ("false", "False", "0", "no"):
        cfg = build_worker_config(_sv(enable_prefix_caching=text), environ={})
        assert cfg.enable_prefix_caching is False and not cfg.engine_config("prefill").enable_prefix_caching
    # decode shares its cached prefix too
    assert WorkerConfig().engine_config("decode").prefix_caching_active


def test_instance_device() -> None:
    from serving.config import instance_device

    assert instance_device("GPU", 1) == "cuda:1" and instance_device("KIND_GPU", 0) == "cuda:0"
    assert instance_device("CPU", 0) == "cpu"
    cfg = build_worker_config(_sv(dtype="bfloat16"), environ={}, device="cuda:1")
    assert cfg.engine_config("prefill").device == "cuda:1"
    assert cfg.engine_config("prefill").dtype == "bfloat16"
    int8 = build_worker_config(_sv(weight_quant="int8"), environ={})
    assert int8.engine_config("decode").weight_quant == "int8"


def test_engine_nice_defaults_to_minus_10_and_is_checked() -> None:
    import pytest

    from serving.config import ConfigError, build_worker_config

    assert build_worker_config({}, environ={}).engine_nice == -10
    assert build_worker_config(_sv(engine_nice="0"), environ={}).engine_nice == 0
    assert build_worker_config(_sv(engine_nice="19"), environ={}).engine_nice == 19
    for bad in ("-21", "20", "high"):
        with pytest.raises(ConfigError, match="engine_nice"):
            build_worker_config(_sv(engine_nice=bad), environ={})


def test_cpu_affinity_parses_validates_and_pins() -> None:
    import os

    import pytest

    from serving.config import ConfigError, apply_cpu_affinity, build_worker_config

    assert build_worker_config({}).cpu_cores == set()
    assert build_worker_config({"cpu_affinity": {"string_value": "0, 1"}}).cpu_cores == {0, 1}
    for bad in ("zero", "-1"):
        with pytest.raises(ConfigError, match="cpu_affinity"):
            build_worker_config({"cpu_affinity": {"string_value": bad}})
    before = os.sched_getaffinity(0)
    try:
        core = min(before)
        apply_cpu_affinity(build_worker_config({"cpu_affinity": {"string_value": str(core)}}))
        assert os.sched_getaffinity(0) == {core}
        with pytest.raises(ConfigError, match="cpu_affinity"):
            apply_cpu_affinity(build_worker_config({"cpu_affinity": {"string_value": "4096"}}))
    finally:
        os.sched_setaffinity(0, before)
