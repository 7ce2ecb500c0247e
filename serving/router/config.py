"""``RouterConfig``: the knobs of one router (``pd_ensemble`` instance), built once from its model parameters.

Environment variables are read in ``serving.config`` only (``PD_REGISTRY_URL``, ``PD_GRPC_URL``, the fleet
secret).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving.config import (
    DEFAULT_BLIP_TOLERANCE_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    ConfigError,
    parse_parameters,
    read_drain_timeout,
    read_etcd_settings,
    read_fleet_secret,
    read_fleet_tls,
    read_grpc_tls,
    read_grpc_url,
    read_registry_url,
    validate_drain_timeout,
    validate_endpoint,
    validate_registry_url,
)

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS
    from serving.triton.grpc_tls import GrpcTls

POLICIES: tuple[str, ...] = ("cache_aware", "load_aware", "round_robin")


@dataclass(frozen=True)
class TargetSpec:
    """One entry of a static instance list: ``model`` (served by the router's own tritonserver) or
    ``model@host:port`` (served by another one)."""

    model_name: str
    endpoint: str


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of one router, fixed for its lifetime.

    Attributes:
        registry_url: the fleet's membership registry (``http://host:port``: the embedded registry service;
            ``etcd://host:port[,...]``: etcd); empty (the default): no registry, the fleet is the PD workers
            of this router's own tritonserver (Triton's repository index). Losing the registry freezes
            membership only: the router keeps its last view and asks each instance's own rendezvous for its
            health.
        grpc_url: this tritonserver's own gRPC endpoint (``host:port``); a bare model name of a static list
            is served there, and without a registry the fleet is found there.
        prefill_models / decode_models: static lists (comma-separated ``model`` or ``model@host:port``);
            empty: every instance of the role the fleet holds is a candidate (discovery).
        policy: ``"cache_aware"`` (default: ``"load_aware"`` with credit for the prefix each instance's cache
            likely holds), ``"load_aware"`` (least queued prompt tokens / most free KV pages) or
            ``"round_robin"`` (``serving/router/pairing.py``).
        direct_decode_max_tokens: prompts shorter than this many tokens go to a decode instance alone, which
            prefills them itself (no KV transfer); 0 turns it off.
        tokenizer: model whose tokenizer counts prompt tokens (``serving`` loader names, ``"smollm2"``);
            empty: estimate 1 token per 3 UTF-8 bytes.
        max_inflight_requests: requests orchestrated at once; more wait in the admission queue.
        max_queued_requests: requests that may wait for admission; beyond it a request gets "server busy".
        queue_timeout_s: longest wait for admission before "server busy", seconds.
        request_idle_timeout_s: a request whose children say nothing for this long is aborted, seconds.
        blip_tolerance_s: a child stream that says nothing while its instance does not answer its rendezvous
            either (no reset, no refusal: a link down, a stalled host) is given up after this many seconds of
            silence (retried before the first token, migrated after); TCP carries an established stream
            through a link-down of up to ~10 s. An instance known dead (its connection refused or reset, its
            rendezvous refusing) is given up at once, or after ``instance_stale_s`` of silence
            (docs/healing.md, "Blips").
        max_retries: attempts on another pair after a failure before the first token (0: none).
        migration_limit: times one request may move to another decode instance when its children fail after
            the first token reached the client (a direct decode that resumes from the tokens already sent); 0:
            such a failure ends the request with the error.
        fleet_refresh_s: how often the membership is read and each instance's load asked, seconds.
        instance_stale_s: an instance not heard from for this long is out of rotation (new requests go to
            others), seconds; its open streams are given up only after ``blip_tolerance_s``.
        fleet_wait_s: a request that finds no healthy prefill or decode instance waits this long for one (the
            fleet asked again every ``fleet_refresh_s``) before it fails with "no healthy ... instance",
            seconds; 0: it fails at once. Covers a router that loaded next to its workers and has not read
            them yet when tritonserver says ready, and a worker rejoining after a restart or a reload; a retry
            that finds no instance but the ones that failed it (by id and epoch) waits the same.
        breaker_failures: consecutive failures that take an instance out of rotation.
        breaker_cooldown_s: how long it stays out before one trial request, seconds.
        drain_timeout_s: a server stop: how long the router lets its open streams run to their end (new ones
            refused) before it ends the rest with an error, seconds; ``PD_DRAIN_TIMEOUT_S`` overrides it. An
            unload needs none: tritonserver waits for the model's requests before ``finalize``.
        health_port: port of the router's readiness endpoint (``GET /ready``: 200 or 503); 0: none.
        worker_endpoints: send child requests to each worker's own endpoint when it has one
            (``serving.workers.endpoint``, child frames over TCP; its ``worker_endpoint`` in the fleet
            listing), past its tritonserver (the default; figures in docs/benchmarks.md "Serving path");
            false: over gRPC through the worker's tritonserver.
        fleet_secret: the fleet secret (env, never a parameter); None: unauthenticated, loopback only.
        grpc_tls: TLS of the router's gRPC channels to tritonservers (its own server's index, children over
            gRPC; ``PD_GRPC_SSL_*``, never a parameter); None: plaintext.
        fleet_tls: TLS of the router's calls to the registry, the instances' rendezvous and the worker
            endpoints (``PD_TLS_*``, never a parameter; ``bootstrap.tls``); None: plaintext. With it an
            ``http://`` ``registry_url`` is refused.
        etcd_settings: etcd's own auth and TLS for an ``etcd://`` registry (``PD_ETCD_*``, never a
            parameter; ``serving.config.read_etcd_settings``).

    Raises:
        ConfigError: at construction, naming the parameter.
    """

    registry_url: str = ""
    grpc_url: str = "127.0.0.1:8001"
    prefill_models: str = ""
    decode_models: str = ""
    policy: str = "cache_aware"
    direct_decode_max_tokens: int = 0
    tokenizer: str = "smollm2"
    max_inflight_requests: int = 256
    max_queued_requests: int = 512
    queue_timeout_s: float = 30.0
    request_idle_timeout_s: float = 300.0
    blip_tolerance_s: float = DEFAULT_BLIP_TOLERANCE_S
    max_retries: int = 1
    migration_limit: int = 3
    fleet_refresh_s: float = 0.25
    instance_stale_s: float = 3.0
    fleet_wait_s: float = 3.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    health_port: int = 0
    worker_endpoints: bool = True
    fleet_secret: bytes | None = field(default=None, repr=False)
    grpc_tls: GrpcTls | None = None
    fleet_tls: FleetTLS | None = None
    etcd_settings: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_inflight_requests", "breaker_failures"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("max_queued_requests", "max_retries", "migration_limit", "direct_decode_max_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "request_idle_timeout_s", "fleet_refresh_s", "instance_stale_s",
                     "breaker_cooldown_s", "blip_tolerance_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)}")
        validate_drain_timeout(self.drain_timeout_s)
        if not self.fleet_wait_s >= 0:
            raise ConfigError("fleet_wait_s", f"must be >= 0 seconds, got {self.fleet_wait_s}")
        if not 0 <= self.health_port <= 65535:
            raise ConfigError("health_port", f"must be a port number, got {self.health_port}")
        validate_registry_url("registry_url", self.registry_url, self.fleet_tls)
        validate_endpoint("grpc_url", self.grpc_url)
        self.static_targets("prefill_models")
        self.static_targets("decode_models")

    def static_targets(self, key: str) -> list[TargetSpec]:
        """The parsed static list ``key`` (``"prefill_models"``/``"decode_models"``); empty: discovery.

        Raises:
            ConfigError: an entry with an empty model name or a bad endpoint.
        """
        specs = []
        for entry in (e.strip() for e in str(getattr(self, key)).split(",")):
            if not entry:
                continue
            model, _, endpoint = entry.partition("@")
            if not model.strip():
                raise ConfigError(key, f"entry {entry!r} has no model name")
            endpoint = endpoint.strip() or self.grpc_url
            validate_endpoint(key, endpoint)
            specs.append(TargetSpec(model.strip(), endpoint))
        return specs


def build_router_config(parameters: Mapping[str, Any],
                        environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The router config from ``model_config["parameters"]`` (``{"key": {"string_value": "..."}}`` or plain
    strings); ``PD_REGISTRY_URL`` / ``PD_GRPC_URL`` / ``PD_DRAIN_TIMEOUT_S`` override ``registry_url`` /
    ``grpc_url`` / ``drain_timeout_s``; the fleet secret
    and the TLS settings (``PD_GRPC_SSL_*``, ``PD_TLS_*``, ``PD_ETCD_*``) come from the environment only.

    Raises:
        ConfigError: an unknown parameter, a value that does not parse, or one out of range.
    """
    values = parse_parameters(parameters, RouterConfig,
                              skip=("fleet_secret", "grpc_tls", "fleet_tls", "etcd_settings"))
    values["registry_url"] = read_registry_url(values.get("registry_url", RouterConfig.registry_url), environ)
    values["fleet_secret"] = read_fleet_secret(environ)
    values["fleet_tls"] = read_fleet_tls(environ)
    values["etcd_settings"] = read_etcd_settings(environ)
    values["grpc_tls"] = read_grpc_tls(environ)
    values["grpc_url"] = read_grpc_url(values.get("grpc_url", RouterConfig.grpc_url), environ)
    drain_timeout_s = values.get("drain_timeout_s", RouterConfig.drain_timeout_s)
    values["drain_timeout_s"] = read_drain_timeout(drain_timeout_s, environ)
    return RouterConfig(**values)
