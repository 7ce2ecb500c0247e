"""Model hyper-parameters of the supported decoder-only architectures (Llama, Qwen2, Mistral; DeepSeek-V3 and
Qwen3-MoE, whose mixture-of-experts and MLA fields are in ``moe_config``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.model.moe_config import MLAConfig, MoEConfig
from engine.model.rope_scaling import RopeScaling, hf_rope_parameters

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "deepseek_v3", "qwen3_moe")

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one model; built once by the loader, read by the model and the KV pool.

    Attributes:
        architecture: ``"llama"``, ``"qwen2"`` or ``"mistral"`` (all share one forward; qwen2 adds q/k/v
            bias); ``"deepseek_v3"`` or ``"qwen3_moe"`` (``engine.model.moe_lm``).
        num_layers, hidden_size, intermediate_size: transformer sizes.
        num_heads, num_kv_heads, head_dim: attention heads (GQA when ``num_kv_heads < num_heads``); with
            ``mla``, what one token's paged KV holds per layer: 1 latent head of ``mla.latent_dim``.
        vocab_size: rows of the embedding and of the logits.
        rope_theta: RoPE base frequency (Su et al. 2021).
        rms_norm_eps: epsilon of every RMSNorm (Zhang & Sennrich 2019).
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2); o_proj never does.
        max_position_embeddings: longest sequence, in tokens, the model (and its RoPE cache) supports.
        bos_token_id: beginning-of-sequence id, or ``None``.
        eos_token_ids: ids that end generation (at least one).
        model_id: stable name of the weights, e.g. ``"smollm2-135m-instruct-q4_1"`` (cache folder, KV compat
            hash).
        moe: the routed experts (``moe_config.MoEConfig``); None for a dense model.
        mla: multi-head latent attention (``moe_config.MLAConfig``); None for GQA.
        qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm``/``k_norm``).
        rope_scaling: how RoPE stretches past the pre-training context (``rope_scaling.LinearScaling``,
            ``Llama3Scaling`` or ``YarnScaling``); None: plain RoPE.

    Raises:
        ValueError: from ``__post_init__`` when a field is out of range or the heads do not divide.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_id: str = "unnamed"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} not in {SUPPORTED_ARCHITECTURES}")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be > 0")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} outside vocab of {self.vocab_size}")

    @property
    def kv_layout_kind(self) -> str:
        """How the paged KV holds a token: ``"mha"`` (a K and a V plane of ``num_kv_heads`` heads) or
        ``"mla"`` (one plane: the latent ``c_kv | k_pe``, no separate V)."""
        return "mla" if self.mla is not None else "mha"

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` transformers reads for this model (so a reference model loads the same
        cache)."""
        return {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_parameters": hf_rope_parameters(self.rope_theta, self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias if self.architecture != "qwen2" else False,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "triton_pd_model_id": self.model_id,
        }

    def as_dict(self) -> dict[str, Any]:
        """All fields as plain values (for logs and compatibility hashes)."""
        return asdict(self)
