"""Hyper-parameters of the mixture-of-experts architectures (DeepSeek-V3, Qwen3-MoE) and of MLA attention.

``MoEConfig`` and ``MLAConfig`` sit inside ``ModelConfig`` (``moe``, ``mla``); ``moe_fields`` reads them, and
the ``ModelConfig`` fields these architectures define differently, from a Hugging Face ``config.json``
(transformers' ``DeepseekV3Config`` / ``Qwen3MoeConfig`` names). Every value the engine cannot serve raises
``ValueError`` naming the ``config.json`` field; the loader turns it into a ``ModelLoadError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")
MOE_ARCHITECTURES: tuple[str, ...] = ("deepseek_v3", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of one model (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.1.2;
    Qwen3 technical report, arXiv:2505.09388).

    Attributes:
        num_experts: routed experts per MoE layer (``n_routed_experts`` / ``num_experts``).
        top_k: experts each token goes to (``num_experts_per_tok``).
        intermediate_size: columns of one expert's SwiGLU (``moe_intermediate_size``).
        scoring_func: ``"softmax"`` (Qwen3-MoE: softmax over all experts, then top-k) or ``"sigmoid"``
            (DeepSeek-V3: sigmoid per expert, the top-k chosen on score + ``e_score_correction_bias``,
            weighted by the score without the bias).
        norm_topk_prob: the top-k weights are divided by their sum.
        routed_scaling_factor: every routed weight is multiplied by it (DeepSeek-V3: 2.5; 1.0 elsewhere).
        n_group, topk_group: group-limited routing (DeepSeek-V3): experts form ``n_group`` equal groups, a
            group scores the sum of its 2 best biased scores, only the ``topk_group`` best groups are
            eligible. ``n_group`` 1 means no grouping.
        num_shared_experts: experts every token passes through, unweighted (one SwiGLU of
            ``num_shared_experts * intermediate_size`` columns; DeepSeek-V3: 1; Qwen3-MoE: 0).
        sparse_layers: the layers whose MLP is the MoE block; the others are dense SwiGLUs of the model's
            ``intermediate_size``.
        correction_bias: the router carries ``e_score_correction_bias`` (DeepSeek-V3's auxiliary-loss-free
            load balancing: it only chooses experts, never weights them).

    Raises:
        ValueError: from ``__post_init__``, naming the field, for a routing the engine cannot run.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    num_shared_experts: int
    sparse_layers: tuple[int, ...]
    correction_bias: bool

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{_HF_NAMES.get(name, name)} must be a positive integer, got {value!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported (one of {SCORING_FUNCS})")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")
        if self.num_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1:
            self._check_groups()
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

    def _check_groups(self) -> None:
        if self.scoring_func != "sigmoid":
            raise ValueError(f"n_group={self.n_group} (group-limited routing) needs scoring_func 'sigmoid'")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide the {self.num_experts} routed experts "
                             "(n_routed_experts)")
        if self.experts_per_group < 2:
            raise ValueError(f"n_group={self.n_group} leaves {self.experts_per_group} expert per group; a "
                             "group is scored by its 2 best experts, so each needs at least 2")
        if self.top_k > self.topk_group * self.experts_per_group:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the {self.topk_group} groups "
                             f"(topk_group) x {self.experts_per_group} experts a token may choose from")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; the V3 report's 2.1.1).

    Attributes:
        q_lora_rank: width of the compressed query (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``); None:
            one ``q_proj`` (DeepSeek-V2-Lite).
        kv_lora_rank: width of the compressed KV latent ``c_kv`` (``kv_a_proj_with_mqa``'s first columns,
            normed by ``kv_a_layernorm``, expanded per head by ``kv_b_proj``).
        qk_nope_head_dim: per-head query/key width without RoPE.
        qk_rope_head_dim: width of the decoupled RoPE query per head and of the one RoPE key shared by all
            heads.
        v_head_dim: per-head value width.
        rope_interleave: the RoPE dimensions are stored as interleaved pairs (``(x0, x1), (x2, x3), ..``;
            transformers' ``rope_interleave``); the loader permutes the weights so the forward rotates halves.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width, ``qk_nope_head_dim + qk_rope_head_dim`` (the softmax scale's)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements one token's cache entry holds per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


_HF_NAMES = {"num_experts": "n_routed_experts / num_experts", "top_k": "num_experts_per_tok",
             "intermediate_size": "moe_intermediate_size"}


def _int(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    value = raw.get(name, default)
    if value is None:
        raise KeyError(name)
    return value


def _deepseek_v3(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if raw.get("attention_bias"):
        raise ValueError("attention_bias true is not supported for deepseek_v3")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"topk_method {raw['topk_method']!r} is not supported (only 'noaux_tc')")
    mla = MLAConfig(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=_int(raw, "kv_lora_rank"),
                    qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
                    qk_rope_head_dim=_int(raw, "qk_rope_head_dim"), v_head_dim=_int(raw, "v_head_dim"),
                    rope_interleave=bool(raw.get("rope_interleave", True)))
    first_dense = int(raw.get("first_k_dense_replace", 0))
    moe = MoEConfig(num_experts=_int(raw, "n_routed_experts"), top_k=_int(raw, "num_experts_per_tok"),
                    intermediate_size=_int(raw, "moe_intermediate_size"),
                    scoring_func=str(raw.get("scoring_func", "sigmoid")),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                    n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
                    num_shared_experts=int(raw.get("n_shared_experts") or 0),
                    sparse_layers=tuple(range(first_dense, num_layers)), correction_bias=True)
    if moe.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func {moe.scoring_func!r} is not supported for deepseek_v3 "
                         "(only 'sigmoid')")
    # the paged cache holds one latent "head" per token: c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)
    return {"mla": mla, "moe": moe, "num_kv_heads": 1, "head_dim": mla.latent_dim}


def _qwen3_moe(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if raw.get("attention_bias"):
        raise ValueError("attention_bias true is not supported for qwen3_moe")
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window true is not supported for qwen3_moe")
    step = int(raw.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in raw.get("mlp_only_layers") or []}
    # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts (its attribute map)
    experts = int(_int(raw, "num_experts", raw.get("num_local_experts")))
    sparse = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    moe = MoEConfig(num_experts=experts, top_k=_int(raw, "num_experts_per_tok"),
                    intermediate_size=_int(raw, "moe_intermediate_size"), scoring_func="softmax",
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), routed_scaling_factor=1.0,
                    n_group=1, topk_group=1, num_shared_experts=0, sparse_layers=sparse,
                    correction_bias=False)
    return {"moe": moe, "qk_norm": True}


def moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` keyword arguments ``arch`` sets beyond the dense models' (``moe``, ``mla``,
    ``qk_norm``, and for MLA ``num_kv_heads`` 1 and ``head_dim`` = the latent width: what the KV pool holds).

    Raises:
        KeyError: a required field is absent (its name).
        ValueError: a field the engine cannot serve (the message names it).
    """
    num_layers = int(raw["num_hidden_layers"])
    if arch == "deepseek_v3":
        return _deepseek_v3(raw, num_layers)
    if arch == "qwen3_moe":
        return _qwen3_moe(raw, num_layers)
    return {}
