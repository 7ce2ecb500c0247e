"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, for inference only.

Architecture (Touvron et al. 2023, "LLaMA"; HF ``modeling_llama`` naming): token embedding; per layer
``x + Attn(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))``; final RMSNorm; LM head (optionally tied to the
embedding). Attention uses RoPE (``rope.py``) and grouped-query heads (Ainslie et al. 2023) through an
``AttentionBackend``; the MLP is SwiGLU (Shazeer 2020): ``down(silu(gate(x)) * up(x))``. For speed, q/k/v are
one matmul and gate/up are one matmul; ``load_weights`` concatenates the HF tensors accordingly. With
``weight_quant="int8"`` the five products per layer and the LM head hold ``linear.Int8Weight``s instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.forward_batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.linear import WEIGHT_QUANTS, embedding, linear, weight_bytes
from engine.model.rope import RotaryEmbedding, apply_rope


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory); ``load_weights`` replaces it with the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    """One transformer block; parameters in the fused layout (``qkv_proj``, ``gate_up_proj``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_norm = _param(h)
        self.qkv_proj = _param(cfg.q_size + 2 * cfg.kv_size, h)  # rows: q | k | v
        self.qkv_bias = _param(cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else None
        self.o_proj = _param(h, cfg.q_size)
        self.post_norm = _param(h)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h)  # rows: gate | up
        self.down_proj = _param(h, cfg.intermediate_size)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                backend: AttentionBackend, metadata: object) -> torch.Tensor:
        """``h`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``; writes this layer's K/V into
        ``layer_kv``."""
        cfg = self.cfg
        n = h.shape[0]
        x = F.rms_norm(h, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        qk_width = cfg.q_size + cfg.kv_size
        qk = qkv[:, :qk_width].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, qk_width:].view(n, cfg.num_kv_heads, cfg.head_dim)
        attn = backend.forward(q, k, v, layer_kv, metadata, self.scale)
        h = h + linear(attn, self.o_proj)
        x = F.rms_norm(h, (cfg.hidden_size,), self.post_norm, cfg.rms_norm_eps)
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    """The model. Build it, then ``load_weights``; until then its parameters are meta placeholders.

    Args:
        config: the model's shapes.
        attention_backend: paged attention implementation; the CPU torch backend when omitted.
        dtype, device: where ``load_weights`` puts the parameters (fp32 / CPU by default); activations and the
            KV cache use ``dtype`` too.
        weight_quant: ``"none"`` or ``"int8"`` (``linear.WEIGHT_QUANTS``): the format ``load_weights`` gives
            the linear layers and the LM head.

    Raises:
        ValueError: ``weight_quant`` is not one of ``WEIGHT_QUANTS``.
    """

    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 weight_quant: str = "none") -> None:
        super().__init__()
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {weight_quant!r}")
        self.config = config
        self.dtype = dtype
        self.weight_quant = weight_quant
        self.device = torch.device(device)
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.attention_backend.bind(config.num_heads, config.num_kv_heads, config.head_dim, dtype)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else _param(config.vocab_size,
                                                                                 config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.rotary = rotary.to(device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step and return next-token logits.

        Args:
            batch: token ids, positions, slot mapping, page tables of this step (same device as the model).
            kv_cache: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``, model dtype; this
                step's K/V are written into it at ``batch.slot_mapping``.

        Returns:
            ``[len(batch.logits_indices), vocab_size]`` float32 logits of the rows ``batch.logits_indices``.
        """
        cfg = self.config
        metadata = self.attention_backend.prepare(batch, int(kv_cache.shape[3]))
        h = embedding(batch.input_ids, self.embed_tokens, self.dtype)
        cos, sin = self.rotary.tables(batch.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], self.attention_backend, metadata)
        h = F.rms_norm(h[batch.logits_indices], (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        return linear(h, self.lm_head).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor], source: str | None = None) -> None:
        """Take HF-named tensors (``model.layers.N.self_attn.q_proj.weight``, ...) as the fused parameters.

        Tensors already in the model's dtype/device are used in place, not copied (q|k|v and gate|up too when
        they lie back to back in memory, as in caches written by the GGUF converter); the caller must not
        modify them afterwards.

        Args:
            state_dict: every tensor of the model under its Hugging Face name (any dtype; converted).
            source: the file or folder they came from, named in errors.

        Raises:
            ModelLoadError: a tensor missing, of the wrong shape, or not part of this architecture.
        """
        from engine.model.weights import WeightMapper

        mapper = WeightMapper(self.config, state_dict, source, self.dtype, self.device, self.weight_quant)
        mapper.load_into(self)

    def streamed_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's products and the LM head (the embedding
        lookup reads one row per token and is left out)."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return sum(weight_bytes(getattr(layer, n)) for layer in self.layers for n in names) + \
            weight_bytes(self.lm_head)
