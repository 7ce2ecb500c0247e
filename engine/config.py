"""Engine configuration: one frozen dataclass, validated once where it is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["colocated", "prefill", "decode"]

MODES: tuple[str, ...] = ("colocated", "prefill", "decode")
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
WEIGHT_QUANTS: tuple[str, ...] = ("none", "int8")  # engine.model.linear.WEIGHT_QUANTS
TP_COLLECTIVES: tuple[str, ...] = ("auto", "shm", "gloo")
MOE_DISPATCHERS: tuple[str, ...] = ("auto", "shm", "all_to_all")
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLMEngine`` needs, fixed for its lifetime.

    Attributes:
        model: model name understood by ``engine.model.load_model`` (``"smollm2"``).
        mode: ``"colocated"`` (prefill + decode), ``"prefill"`` (prompt only, KV kept for transfer) or
            ``"decode"`` (continues requests whose prompt KV arrived from a prefill engine).
        page_size: tokens per KV page.
        num_pages: KV pool size in pages; exclusive with ``kv_cache_bytes``.
        kv_cache_bytes: KV pool size in bytes (rounded down to whole pages); used when ``num_pages`` is None,
            default 512 MiB.
        chunk_size: most prompt tokens of one request in one step (chunked prefill).
        max_num_batched_tokens: per-step token budget over all requests (decode tokens + prefill chunks).
        max_running_requests: most requests admitted (holding pages and scheduled) at once.
        max_model_len: longest prompt + max_tokens accepted; None = the model's context length.
        num_threads: ``torch.set_num_threads`` at engine start.
        device: torch device string (``"cpu"``, ``"cuda:0"``).
        dtype: weights and KV dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``).
        weight_quant: ``"none"`` (weights in ``dtype``) or ``"int8"`` (weight-only int8 per output channel,
            quantized at load; activations and KV stay in ``dtype``); see ``engine/model/linear.py``.
        seed: seeds the engine's generator used by requests that give no seed of their own.
        cache_dir: where the model loader keeps its converted weights; None = its default.
        enable_prefix_caching: keep full KV pages of past requests, keyed by their tokens, and let new
            requests share their longest cached prefix (``engine/prefix_cache.py``). In every mode: colocated
            and prefill skip the compute of the cached prefix; decode (``reserve_request``) shares it and
            tells the prefill side, which then sends only the rest of the prompt's KV.
        tensor_parallel_size: ranks the model is split over (``engine/parallel``, docs/parallelism.md): this
            process is rank 0 and starts ranks 1..N-1 as processes of its own; 1 (the default) runs the whole
            model here. Must fit the model's heads (checked at load: ``engine.parallel.layout``). Each rank
            runs ``num_threads`` torch threads and holds ``num_pages`` pages of its own KV heads; sized by
            ``kv_cache_bytes``, that budget is per rank.
        expert_parallel_size: ranks the routed experts of an MoE model (DeepSeek-V3, Qwen3-MoE) are spread
            over (docs/moe.md): this process is rank 0 of N rank processes, as with ``tensor_parallel_size``;
            each rank holds ``num_experts / N`` experts, tokens reach them through the dispatcher
            ``moe_dispatcher`` names, and attention, dense layers and the LM head
            are tensor-parallel over the same N ranks (attention TP size = EP size, as SGLang runs EP).
            1 (the default): every expert here. Exclusive with ``tensor_parallel_size`` > 1; must divide the
            model's experts and attention heads (checked at load, naming it).
        enable_dp_attention: DP attention over the instance's ranks (``tensor_parallel_size`` for a dense
            model, ``expert_parallel_size`` for an MoE one, N > 1; docs/parallelism.md, "DP attention"): each
            rank holds every attention head and its own KV pool (``num_pages`` pages, its own page ids) and
            runs attention on its own requests, which this process's scheduler assigns (least-loaded rank);
            dense MLPs stay split by columns over every rank's tokens, MoE layers expert-parallel. The
            instance holds N x the tokens of one pool. In prefill and decode mode (CPU) the ranks' pools are
            one region whose page ids ``rank * num_pages + p`` the KV transfer addresses
            (``LLMEngine.kv_pools``).
        tp_timeout_s: how long a rank waits for the others inside a step before the group fails (a rank that
            hangs); a rank process that dies fails the group within ~50 ms instead.
        tp_collectives: ``"auto"`` (CPU: shared-memory collectives, ``engine.parallel.shm``, where its C file
            builds, else gloo; CUDA: NCCL), ``"shm"`` (required) or ``"gloo"`` (torch's gloo process group; on
            this project's hosts ~1-2 ms per all-reduce, for comparison).
        moe_dispatcher: how an expert-parallel instance's MoE layers move tokens between its ranks:
            ``"auto"`` (CPU ranks with shared-memory collectives: ``"shm"`` when one step's exchange fits
            ``engine.parallel.group.MOE_SHM_SLOT_CAP`` bytes per slot; else ``"all_to_all"``), ``"shm"``
            (``engine.model.shm_dispatch.SharedMemoryDispatcher``, through the collectives' shared region;
            required: the start fails when it cannot be used) or ``"all_to_all"``
            (``engine.model.moe_dispatch.AllToAllDispatcher``: ``all_to_all_single`` over the ranks' gloo or
            NCCL process group).

    Raises:
        ValueError: at construction, naming the field, when a value is out of range.
    """

    model: str = "smollm2"
    mode: Mode = "colocated"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    chunk_size: int = 512
    max_num_batched_tokens: int = 512
    max_running_requests: int = 64
    max_model_len: int | None = None
    num_threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    weight_quant: str = "none"
    seed: int = 0
    cache_dir: str | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    enable_dp_attention: bool = False
    tp_timeout_s: float = 10.0
    tp_collectives: str = "auto"
    moe_dispatcher: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {self.weight_quant!r}")
        if self.tp_collectives not in TP_COLLECTIVES:
            raise ValueError(f"tp_collectives must be one of {TP_COLLECTIVES}, got {self.tp_collectives!r}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"moe_dispatcher must be one of {MOE_DISPATCHERS}, got {self.moe_dispatcher!r}")
        if not isinstance(self.tp_timeout_s, (int, float)) or not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be > 0 seconds, got {self.tp_timeout_s!r}")
        for name in ("page_size", "chunk_size", "max_num_batched_tokens", "max_running_requests",
                     "num_threads", "tensor_parallel_size", "expert_parallel_size"):
            _require_positive(name, getattr(self, name))
        if self.expert_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: an expert-parallel instance splits attention "
                             "over its own ranks; give one of them")
        self._check_dp_attention()
        if not isinstance(self.enable_prefix_caching, bool):
            # ValueError like every other field here (the documented contract), not TypeError
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")  # noqa: TRY004
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_pages or kv_cache_bytes, not both")
        for name in ("num_pages", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None:
                _require_positive(name, value)

    def _check_dp_attention(self) -> None:
        if not isinstance(self.enable_dp_attention, bool):
            # ValueError like every other field here (the documented contract), not TypeError
            raise ValueError(f"enable_dp_attention must be a bool, got {self.enable_dp_attention!r}")  # noqa: TRY004
        if not self.enable_dp_attention:
            return
        if self.num_ranks == 1:
            raise ValueError("enable_dp_attention needs ranks: tensor_parallel_size (a dense model) or "
                             "expert_parallel_size (an MoE model) > 1")

    @property
    def dp_size(self) -> int:
        """DP-attention ranks: ``num_ranks`` with ``enable_dp_attention``, else 1."""
        return self.num_ranks if self.enable_dp_attention else 1

    @property
    def num_ranks(self) -> int:
        """Rank processes of the instance, this one included (``tensor_parallel_size`` or
        ``expert_parallel_size``, whichever is > 1; else 1)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def prefix_caching_active(self) -> bool:
        """Whether the engine runs its prefix cache (every mode: ``enable_prefix_caching``)."""
        return self.enable_prefix_caching

    @property
    def pool_bytes(self) -> int:
        """Byte budget of the KV pool when sized by bytes (``num_pages`` is None)."""
        return self.kv_cache_bytes if self.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
