"""Worker configuration: one frozen dataclass built from a Triton model config's ``parameters``.

This module is the only place in ``serving/`` that reads environment variables:

* ``PD_REGISTRY_URL`` overrides the ``registry_url`` parameter: the fleet's membership registry (``http://``:
  the embedded registry service, ``etcd://``: etcd; empty: none, a router pairs the workers of its own
  server);
* ``PD_FLEET_SECRET`` / ``PD_FLEET_SECRET_FILE`` (read by ``bootstrap.auth.load_fleet_secret``, called from
  here only): the fleet secret that signs rendezvous and registry calls;
* ``PD_TLS_CERT`` / ``PD_TLS_KEY`` / ``PD_TLS_CA`` (read by ``bootstrap.tls.load_fleet_tls``, called from here
  only; ``read_fleet_tls``): TLS of the fleet's own listeners (rendezvous, registry, worker endpoints);
* ``PD_GRPC_URL`` overrides the ``grpc_url`` parameter: the ``host:port`` at which this tritonserver's gRPC
  endpoint is reached by routers (``scripts/serve.sh`` sets it from ``ADVERTISE_HOST`` and ``GRPC_PORT``);
* ``PD_GRPC_SSL_ROOT_CERT`` (and ``PD_GRPC_SSL_CLIENT_CERT`` / ``_CLIENT_KEY``, ``PD_GRPC_SSL_TARGET_NAME``):
  TLS of our gRPC clients of tritonservers (``read_grpc_tls``; ``scripts/serve.sh`` sets them from its
  ``GRPC_SSL_*``);
* a KV backend's own environment overrides (``PD_KV_NETWORK_ONLY`` for NIXL's ``kv_network_only``,
  docs/multihost.md), read by ``kv_transfer.backends.parse_options`` with the environment passed from here;
* ``PD_DRAIN_TIMEOUT_S`` overrides every model's ``drain_timeout_s`` parameter (``read_drain_timeout``:
  ``scripts/serve.sh`` sets it from its ``DRAIN_TIMEOUT_S`` together with tritonserver's exit timeout);
* ``PD_ETCD_USER`` / ``PD_ETCD_PASSWORD`` / ``PD_ETCD_CA`` / ``PD_ETCD_CERT`` / ``PD_ETCD_KEY``: etcd's own
  auth and TLS, for an ``etcd://`` registry (``read_etcd_settings``; ``bootstrap.membership.make_membership``
  takes them as values).

Everything below gets values from the configs built here; the transport libraries' own variables (``UCX_*``,
``MC_*``), which those libraries read themselves, are defaulted in ``kv_transfer.network``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from engine.config import DTYPES, MOE_DISPATCHERS, WEIGHT_QUANTS, EngineConfig, Mode
from kv_transfer.backends import (
    BackendOptions,
    OptionError,
    backend_names,
    option_parameters,
    options_type,
    parse_options,
)

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS
    from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)

KV_BACKENDS: tuple[str, ...] = backend_names()   # kv_transfer.backends registers them
REGISTRY_URL_ENV = "PD_REGISTRY_URL"
REGISTRY_SCHEMES: tuple[str, ...] = ("http://", "https://", "etcd://")
GRPC_URL_ENV = "PD_GRPC_URL"
DRAIN_TIMEOUT_ENV = "PD_DRAIN_TIMEOUT_S"
#: How long a stopping server lets its open streams run to their end, seconds (``drain_timeout_s``).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: How long a peer or child that says nothing (no answer, no reset) is waited for before it counts as lost,
#: seconds (``blip_tolerance_s``): TCP's own retransmissions carry an established connection through a
#: link-down of up to ~10 s; a refused or reset connection (the process is gone) is a death at once, whatever
#: this says.
DEFAULT_BLIP_TOLERANCE_S = 15.0


class ConfigError(ValueError):
    """A worker parameter is missing its constraint.

    Attributes:
        param: the parameter's name as written in ``config.pbtxt``.
        reason: what is wrong with its value.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"model parameter {param!r}: {reason}")
        self.param = param
        self.reason = reason


@dataclass(frozen=True)
class WorkerConfig:
    """Knobs of one serving worker (one Triton model instance), fixed for its lifetime.

    Attributes:
        model: model name understood by the engine's loader (``"smollm2"``).
        page_size: tokens per KV page.
        num_pages: KV pool size in pages (``bytes = num_pages * page_size * bytes_per_token``).
        chunk_size: most prompt tokens of one request per engine step (chunked prefill).
        max_num_batched_tokens: per-step token budget over the whole batch.
        num_threads: torch intra-op threads of the engine.
        registry_url: the fleet's membership registry (``http://host:port``, ``etcd://host:port[,...]``),
            where PD workers announce themselves and routers watch the fleet; empty (the default): none, a
            router then pairs the workers of its own tritonserver (found through Triton's repository index).
        rendezvous_port: port of the instance's own rendezvous server (PD workers), on the host of
            ``grpc_url``; 0 (the default) picks a free one (routers learn it from the instance).
        worker_port: port of the PD worker's own endpoint (``serving.workers.endpoint``: routers send its
            child requests there, past tritonserver), on the host of ``grpc_url``; 0 (the default) picks a
            free one (routers learn it from the instance's rendezvous); -1: none (routers go through
            tritonserver).
        kv_backend: a registered KV backend (``kv_transfer.backends``): ``"nixl"``, ``"mooncake"`` or
            ``"inprocess"`` (PD workers only).
        kv_options: the ``kv_backend``'s own options (``NixlOptions``, ``MooncakeOptions``, ...), built by
            ``build_worker_config`` from the parameters ``kv_<option>`` that backend owns
            (``kv_network_only``, ``kv_protocol``, ``kv_device``) and its environment overrides; None: the
            backend's defaults.
        grpc_url: ``host:port`` of this tritonserver's gRPC endpoint as routers reach it (PD workers announce
            it; Triton's default port is 8001); its host is also where the KV transport and the rendezvous
            listen.
        bootstrap_timeout_s: how long a PD request may wait for its peer to show up at the rendezvous.
        waiting_timeout_s: how long a PD request may wait for its KV once the transfer was set up.
        idle_wait_s: longest block of the engine loop on its input queue when there is nothing to do.
        engine_nice: nice value of the engine loop thread, -20..19 (``EngineLoop``'s ``nice``: that thread
            alone, and torch's intra-op threads it starts); -10 by default, so that the server's other threads
            and a local client do not preempt engine steps (serving/workers/engine_loop.py); without
            ``CAP_SYS_NICE`` the thread keeps the process's priority (a warning in the log).
        dtype: weights and KV dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
        weight_quant: ``"none"`` or ``"int8"`` (weight-only int8, quantized at load; ``EngineConfig``). The
            shipped configs keep ``float32``/``none`` (token-exact with transformers); docs/benchmarks.md
            ("Weight formats") gives the fastest mode whose quality holds on each machine.
        device: torch device of the engine; set from the Triton instance (``instance_device``), not a
            parameter.
        cpu_affinity: CPU cores the instance's process runs on, comma-separated (``"0"``, ``"2,3"``); empty:
            no pinning. Applied by ``apply_cpu_affinity`` before the engine's threads start.
        enable_prefix_caching: the engine's prefix cache (``EngineConfig.enable_prefix_caching``): on by
            default; ``"false"`` turns it off. Every worker uses it: decode shares the pages it already holds
            and prefill sends only the rest of the prompt's KV.
        tensor_parallel_size: ranks the model is split over (``EngineConfig.tensor_parallel_size``): the stub
            is rank 0 and starts ranks 1..N-1 as processes of its own; 1 (the default): none. Must fit the
            model's heads (checked when the model loads: a bad value fails the load, naming it). Colocated
            models only for now: prefill and decode refuse N > 1 until the KV transfer moves each rank's
            heads.
        expert_parallel_size: ranks the routed experts of an MoE model are spread over
            (``EngineConfig.expert_parallel_size``): the stub is rank 0 and starts ranks 1..N-1, attention is
            tensor-parallel over the same ranks. Must divide the model's experts and attention heads and be
            used without ``tensor_parallel_size`` (a bad value fails the load, naming it).
        enable_dp_attention: DP attention over the instance's ranks (``EngineConfig.enable_dp_attention``,
            docs/parallelism.md): with ``tensor_parallel_size`` (a dense model) or ``expert_parallel_size``
            (an MoE model) N > 1, each rank runs attention on its own requests over its own KV pool of
            ``num_pages`` pages (N x the tokens of one pool); ``false`` by default. Prefill and decode models
            (CPU) register the ranks' pools as one region: a request's KV lands in its rank's pool.
        tp_timeout_s: how long a rank waits for the others inside a step before the instance's engine fails
            (a hung rank); a rank process that dies fails it within ~50 ms.
        moe_dispatcher: how an expert-parallel instance's MoE layers move tokens between its ranks
            (``EngineConfig.moe_dispatcher``): ``auto`` (the default: through the ranks' shared memory on the
            CPU), ``shm`` (that, required) or ``all_to_all`` (gloo's all-to-all).
        drain_timeout_s: a server stop or an unload: how long the requests in flight may run to their end
            before they are ended with an error, seconds (``serving.triton.host.ModelHost``; docs/healing.md
            "Stops"). ``PD_DRAIN_TIMEOUT_S`` overrides it. tritonserver's ``--exit-timeout-secs`` must exceed
            it (serve.sh: by 15 s), or tritonserver exits under the streams.
        blip_tolerance_s: a KV peer whose rendezvous does not answer (no reset, no refusal: a link down, a
            stalled host) is lost only after this many seconds of silence; a refused connection loses it at
            once (``KVArgs.peer_lost_s``).
        fleet_secret: the fleet secret (env, never a parameter); None: unauthenticated, loopback only.
        fleet_tls: TLS of the instance's rendezvous and worker endpoint and of its calls to peers' and to the
            registry (``PD_TLS_*``, never a parameter; ``bootstrap.tls``); None: plaintext. With it an
            ``http://`` ``registry_url`` is refused.
        etcd_settings: etcd's own auth and TLS for an ``etcd://`` registry (``PD_ETCD_*``, never a
            parameter; ``read_etcd_settings``).

    Raises:
        ConfigError: at construction, naming the parameter, when a value is out of range.
    """

    model: str = "smollm2"
    page_size: int = 16
    num_pages: int = 1024
    chunk_size: int = 512
    max_num_batched_tokens: int = 512
    num_threads: int = 1
    registry_url: str = ""
    rendezvous_port: int = 0
    worker_port: int = 0
    kv_backend: str = "nixl"
    kv_options: BackendOptions | None = None
    grpc_url: str = "127.0.0.1:8001"
    bootstrap_timeout_s: float = 120.0
    waiting_timeout_s: float = 120.0
    idle_wait_s: float = 0.1
    engine_nice: int = -10
    dtype: str = "float32"
    weight_quant: str = "none"
    device: str = "cpu"
    cpu_affinity: str = ""
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    enable_dp_attention: bool = False
    tp_timeout_s: float = 10.0
    moe_dispatcher: str = "auto"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    blip_tolerance_s: float = DEFAULT_BLIP_TOLERANCE_S
    fleet_secret: bytes | None = field(default=None, repr=False)
    fleet_tls: FleetTLS | None = None
    etcd_settings: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "chunk_size", "max_num_batched_tokens", "num_threads",
                     "tensor_parallel_size", "expert_parallel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.expert_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ConfigError("expert_parallel_size",
                              f"must be 1 with tensor_parallel_size={self.tensor_parallel_size}, got "
                              f"{self.expert_parallel_size}: an expert-parallel instance splits attention "
                              "over its own ranks")
        if self.enable_dp_attention and max(self.tensor_parallel_size, self.expert_parallel_size) == 1:
            raise ConfigError("enable_dp_attention", "needs tensor_parallel_size (a dense model) or "
                                                     "expert_parallel_size (an MoE model) > 1")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "idle_wait_s", "tp_timeout_s",
                     "blip_tolerance_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)}")
        validate_drain_timeout(self.drain_timeout_s)
        if not -20 <= self.engine_nice <= 19:
            raise ConfigError("engine_nice", f"must be -20..19, got {self.engine_nice}")
        if not self.model:
            raise ConfigError("model", "must not be empty")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError("kv_backend", f"must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if self.kv_options is not None and type(self.kv_options) is not options_type(self.kv_backend):
            raise ConfigError("kv_backend", f"{self.kv_backend!r} takes "
                                            f"{options_type(self.kv_backend).__name__}, "
                                            f"got {type(self.kv_options).__name__}")
        validate_registry_url("registry_url", self.registry_url, self.fleet_tls)
        if not 0 <= self.rendezvous_port < 65536:
            raise ConfigError("rendezvous_port", f"must be 0..65535, got {self.rendezvous_port}")
        if not -1 <= self.worker_port < 65536:
            raise ConfigError("worker_port", f"must be -1 (none) or 0..65535, got {self.worker_port}")
        validate_endpoint("grpc_url", self.grpc_url)
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ConfigError("weight_quant", f"must be one of {WEIGHT_QUANTS}, got {self.weight_quant!r}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError("moe_dispatcher",
                              f"must be one of {MOE_DISPATCHERS}, got {self.moe_dispatcher!r}")
        try:
            cores = self.cpu_cores
        except ValueError:
            raise ConfigError("cpu_affinity",
                              f"must be comma-separated core ids, got {self.cpu_affinity!r}") from None
        if any(c < 0 for c in cores):
            raise ConfigError("cpu_affinity", f"core ids must be >= 0, got {self.cpu_affinity!r}")
        if self.max_num_batched_tokens < self.chunk_size:
            raise ConfigError("max_num_batched_tokens",
                              f"must be >= chunk_size ({self.chunk_size}), got {self.max_num_batched_tokens}")

    @property
    def cpu_cores(self) -> set[int]:
        """The cores of ``cpu_affinity`` (empty: no pinning). Raises ValueError on a non-integer entry."""
        return {int(c) for c in self.cpu_affinity.split(",") if c.strip()}

    @property
    def kv_cache_tokens(self) -> int:
        """Capacity of the KV pool in tokens."""
        return self.num_pages * self.page_size

    def engine_config(self, mode: Mode) -> EngineConfig:
        """The engine configuration of this worker in ``mode`` (``"colocated"``, ``"prefill"``,
        ``"decode"``)."""
        return EngineConfig(model=self.model, mode=mode, page_size=self.page_size,
                            num_pages=self.num_pages, chunk_size=self.chunk_size,
                            max_num_batched_tokens=self.max_num_batched_tokens, num_threads=self.num_threads,
                            device=self.device, dtype=self.dtype, weight_quant=self.weight_quant,
                            enable_prefix_caching=self.enable_prefix_caching,
                            tensor_parallel_size=self.tensor_parallel_size,
                            expert_parallel_size=self.expert_parallel_size,
                            enable_dp_attention=self.enable_dp_attention, tp_timeout_s=self.tp_timeout_s,
                            moe_dispatcher=self.moe_dispatcher)


def instance_device(kind: str, device_id: int) -> str:
    """Torch device of a Triton model instance: ``"cuda:<id>"`` for ``KIND_GPU`` (``"GPU"``), else
    ``"cpu"``."""
    return f"cuda:{device_id}" if kind.upper().endswith("GPU") else "cpu"


def apply_cpu_affinity(config: WorkerConfig) -> None:
    """Pin the calling thread, and so every thread it starts later (the engine loop, torch's pool), to
    ``config.cpu_cores``; nothing when empty. Call it in ``initialize`` before building the worker.

    Raises:
        ConfigError: a core this machine does not have (``os.sched_setaffinity`` refused it).
    """
    if not config.cpu_cores:
        return
    try:
        os.sched_setaffinity(0, config.cpu_cores)
    except OSError as e:
        raise ConfigError("cpu_affinity", f"cannot pin to cores {sorted(config.cpu_cores)}: {e}") from None


def read_registry_url(configured: str, environ: Mapping[str, str] | None = None) -> str:
    """The membership registry: ``PD_REGISTRY_URL`` from the environment when set, else ``configured``."""
    env = os.environ if environ is None else environ
    return env.get(REGISTRY_URL_ENV, configured)


def read_drain_timeout(configured: float, environ: Mapping[str, str] | None = None) -> float:
    """The drain timeout: ``PD_DRAIN_TIMEOUT_S`` from the environment when set, else ``configured`` (seconds).
    Raises ``ConfigError`` when the variable is not a number >= 0."""
    env = os.environ if environ is None else environ
    text = env.get(DRAIN_TIMEOUT_ENV, "")
    if not text:
        return configured
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(DRAIN_TIMEOUT_ENV, f"must be a number of seconds, got {text!r}") from None
    validate_drain_timeout(value, DRAIN_TIMEOUT_ENV)
    return value


def validate_drain_timeout(value: float, param: str = "drain_timeout_s") -> None:
    """Raise ``ConfigError(param)`` unless ``value`` is a number of seconds >= 0 (0: no drain, a stop ends the
    requests in flight at once)."""
    if not value >= 0:
        raise ConfigError(param, f"must be >= 0 seconds, got {value}")


def read_fleet_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The fleet secret (``PD_FLEET_SECRET`` or ``PD_FLEET_SECRET_FILE``); None when neither is set. Raises
    ``ConfigError`` when the file cannot be read or both are set."""
    from bootstrap.auth import AuthError, load_fleet_secret

    try:
        return load_fleet_secret(os.environ if environ is None else environ)
    except AuthError as e:
        raise ConfigError("PD_FLEET_SECRET", str(e)) from None


def read_fleet_tls(environ: Mapping[str, str] | None = None) -> FleetTLS | None:
    """TLS of the fleet's own listeners and their clients (``PD_TLS_CERT``, ``PD_TLS_KEY``, ``PD_TLS_CA``: all
    three or none; ``bootstrap.tls``); None (plaintext) when none is set. Raises ``ConfigError`` naming the
    variable when only some are set, a file does not exist, or the certificate and key do not load."""
    from bootstrap.tls import CERT_ENV, TLSError, load_fleet_tls

    try:
        return load_fleet_tls(os.environ if environ is None else environ)
    except TLSError as e:
        raise ConfigError(CERT_ENV, str(e)) from None


def read_etcd_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """etcd's own auth and TLS settings (``PD_ETCD_USER``, ``PD_ETCD_PASSWORD``, ``PD_ETCD_CA``,
    ``PD_ETCD_CERT``, ``PD_ETCD_KEY``: ``bootstrap.membership.ETCD_ENV``), those set, by name; checked when
    the membership is made (``EtcdOptions``)."""
    from bootstrap.membership.etcd_client import ETCD_ENV

    env = os.environ if environ is None else environ
    return {name: env[name] for name in ETCD_ENV if env.get(name)}


GRPC_SSL_ENV = ("PD_GRPC_SSL_ROOT_CERT", "PD_GRPC_SSL_CLIENT_CERT", "PD_GRPC_SSL_CLIENT_KEY",
                "PD_GRPC_SSL_TARGET_NAME")


def read_grpc_tls(environ: Mapping[str, str] | None = None) -> GrpcTls | None:
    """TLS of this process's gRPC channels to tritonservers: ``PD_GRPC_SSL_ROOT_CERT`` (the fleet's CA, PEM)
    turns it on; ``PD_GRPC_SSL_CLIENT_CERT`` / ``PD_GRPC_SSL_CLIENT_KEY`` add a client certificate (servers
    with ``--grpc-use-ssl-mutual``); ``PD_GRPC_SSL_TARGET_NAME`` is the name servers' certificates are checked
    against instead of the dialed host. None (plaintext) when the root is unset. Raises ``ConfigError`` when a
    file cannot be read, a client certificate comes without its key, or a client setting without the root."""
    from serving.triton.grpc_tls import GrpcTls, GrpcTlsError

    env = os.environ if environ is None else environ
    root, cert, key, name = (env.get(var, "") for var in GRPC_SSL_ENV)
    if not root:
        if cert or key or name:
            raise ConfigError(GRPC_SSL_ENV[0], "must be set when any other PD_GRPC_SSL_* variable is")
        return None
    try:
        return GrpcTls(root, cert, key, name)
    except GrpcTlsError as e:
        raise ConfigError(GRPC_SSL_ENV[0], str(e)) from None


def validate_registry_url(param: str, url: str, tls: FleetTLS | None = None) -> None:
    """Raise ``ConfigError(param)`` unless ``url`` is empty or ``http(s)://`` / ``etcd://``, or when it is
    ``http://`` while the fleet speaks TLS (``tls`` set: the registry is ``https://``)."""
    if url and not url.startswith(REGISTRY_SCHEMES):
        raise ConfigError(param, f"must be empty, http://host:port or etcd://host:port[,...], got {url!r}")
    if tls is not None and url.startswith("http://"):
        raise ConfigError(param, f"is plaintext ({url}) while PD_TLS_* are set: the registry serves "
                                 "https:// in a TLS fleet")


DEFAULT_GRPC_URL = "127.0.0.1:8001"


def read_grpc_url(configured: str, environ: Mapping[str, str] | None = None,
                  server_argv: list[str] | None = None) -> str:
    """This server's gRPC endpoint as others reach it: ``PD_GRPC_URL`` when set; else ``configured`` when the
    model config names one; else what the tritonserver running this stub listens on (its ``--grpc-port`` and
    ``--grpc-address``, read from the parent process's command line: plain ``tritonserver`` on any port needs
    no setting); else Triton's default, ``127.0.0.1:8001``.

    ``server_argv``: the server's command line (tests); None reads ``/proc/<parent pid>/cmdline``."""
    env = os.environ if environ is None else environ
    if env.get(GRPC_URL_ENV):
        return env[GRPC_URL_ENV]
    if configured and configured != DEFAULT_GRPC_URL:
        return configured
    return server_grpc_endpoint(_parent_argv() if server_argv is None else server_argv) or DEFAULT_GRPC_URL


def server_grpc_endpoint(argv: list[str]) -> str | None:
    """``host:port`` of a tritonserver command line's gRPC service (``--grpc-port``, default 8001; the address
    ``--grpc-address``, a wildcard or none meaning loopback for the same host); None when ``argv`` is no
    tritonserver's."""
    if not argv or not os.path.basename(argv[0]).startswith("tritonserver"):
        return None
    options: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--grpc-port") or arg.startswith("--grpc-address"):
            name, eq, value = arg.partition("=")
            options[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    host = options.get("--grpc-address", "")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
    return f"{host}:{options.get('--grpc-port', '8001')}"


def _parent_argv() -> list[str]:
    """The parent process's command line (a python-backend stub's parent is its tritonserver); [] if
    unreadable."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def validate_endpoint(param: str, endpoint: str) -> None:
    """Raise ``ConfigError(param)`` unless ``endpoint`` is ``host:port`` with a port in 1..65535."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(param, f"must be host:port, got {endpoint!r}")


def parse_parameters(parameters: Mapping[str, Any], config_cls: type, skip: tuple[str, ...] = (),
                     also_known: tuple[str, ...] = ()) -> dict[str, Any]:
    """``model_config["parameters"]`` → field values of the frozen dataclass ``config_cls``.

    Args:
        parameters: ``{"page_size": {"string_value": "16"}, ...}``; plain ``{"page_size": "16"}`` too.
        config_cls: the config dataclass whose field types (int, float, str) the values are parsed to.
        skip: fields that are not parameters (set by the caller).
        also_known: parameters the caller reads itself (named in the unknown-parameter error's list).
    Raises:
        ConfigError: an unknown parameter or a value that does not parse.
    """
    types = {f.name: f.type for f in fields(config_cls) if f.name not in skip}
    values: dict[str, Any] = {}
    for name, raw in parameters.items():
        if name not in types:
            raise ConfigError(name, f"unknown parameter (known: {sorted([*types, *also_known])})")
        values[name] = _parse(name, types[name], _text(raw).strip())
    return values


def _text(raw: Any) -> str:
    """A parameter's value as Triton passes it (``{"string_value": "16"}``) or plain (``"16"``)."""
    return str(raw.get("string_value", "")) if isinstance(raw, Mapping) else str(raw)


def build_worker_config(parameters: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                        device: str = "cpu") -> WorkerConfig:
    """Build the worker config from a model config's ``parameters`` section.

    Args:
        parameters: ``model_config["parameters"]`` as Triton passes it to ``initialize``:
            ``{"page_size": {"string_value": "16"}, ...}``; plain ``{"page_size": "16"}`` is accepted too.
            Missing keys keep their defaults.
        environ: environment to read overrides from; ``os.environ`` when None.
        device: the instance's torch device (``instance_device(args["model_instance_kind"], ...)``).
    Returns:
        The validated, frozen ``WorkerConfig``.
    Raises:
        ConfigError: an unknown parameter, a value that does not parse, or one out of range.
    """
    owned = option_parameters()
    values = parse_parameters({k: v for k, v in parameters.items() if k not in owned}, WorkerConfig,
                              skip=("device", "fleet_secret", "fleet_tls", "kv_options", "etcd_settings"),
                              also_known=tuple(owned))
    config = WorkerConfig(**values, device=device)
    backend_params = {k: _text(v) for k, v in parameters.items() if k in owned}
    for name in backend_params:
        if config.kv_backend not in owned[name]:
            logger.warning("model parameter %r is an option of KV backend %s, not of %r: ignored", name,
                           "/".join(owned[name]), config.kv_backend)
    try:
        kv_options = parse_options(config.kv_backend, backend_params,
                                   os.environ if environ is None else environ)
    except OptionError as exc:
        raise ConfigError(exc.param, exc.reason) from None
    return replace(config, registry_url=read_registry_url(config.registry_url, environ),
                   grpc_url=read_grpc_url(config.grpc_url, environ), fleet_secret=read_fleet_secret(environ),
                   drain_timeout_s=read_drain_timeout(config.drain_timeout_s, environ),
                   fleet_tls=read_fleet_tls(environ), kv_options=kv_options,
                   etcd_settings=read_etcd_settings(environ))


def _parse(name: str, type_name: Any, text: str) -> Any:
    """Convert one ``string_value`` to the field's type (annotations are strings under postponed
    evaluation)."""
    kind = type_name if isinstance(type_name, str) else type_name.__name__
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ConfigError(name, f"must be a{'n int' if kind == 'int' else ' number'}, got {text!r}") from None
    if kind == "bool":
        if text.lower() not in _BOOLS:
            raise ConfigError(name, f"must be true or false, got {text!r}")
        return _BOOLS[text.lower()]
    return text


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
