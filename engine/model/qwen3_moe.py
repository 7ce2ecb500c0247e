"""``Qwen3MoeForCausalLM`` (Qwen3 technical report, arXiv:2505.09388; transformers' ``modeling_qwen3_moe``):
grouped-query attention with an RMSNorm over each query and key head before RoPE (``q_norm``, ``k_norm``),
MoE blocks with softmax top-k routing (``norm_topk_prob``) on the layers that are not in ``mlp_only_layers``
and fall on ``decoder_sparse_step``, dense SwiGLUs elsewhere. The paged KV is the dense models' (K and V
planes of ``num_key_value_heads`` heads); the attention backend is chosen for the device as for Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, select_backend
from engine.model.config import ModelConfig
from engine.model.moe import Take
from engine.model.moe_dispatch import TokenDispatcher
from engine.model.moe_lm import CheckpointTensors, MoEDecoderLM
from engine.model.rope import apply_rope
from engine.parallel.layout import RankShard, whole_model


class QKNormAttention(nn.Module):
    """One layer's GQA with per-head q/k RMSNorm (Qwen3), q/k/v fused into one product.

    Args:
        cfg: the model; take, prefix: the checkpoint's tensors, ``"model.layers.N.self_attn."``;
        dtype, device: where the weights go.
        shard: a tensor-parallel rank's heads (``engine.parallel.layout.RankShard``: its query heads and
            KV heads, column-parallel q/k/v, row-parallel o, so its output is a partial sum the caller
            all-reduces); None: every head.

    Raises:
        ModelLoadError: from ``take``.
    """

    def __init__(self, cfg: ModelConfig, take: Take, prefix: str, dtype: torch.dtype,
                 device: torch.device, shard: RankShard | None = None) -> None:
        super().__init__()
        shard = shard if shard is not None else whole_model(cfg)
        self.heads, self.kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.eps, h = cfg.rms_norm_eps, cfg.hidden_size
        q, kv = slice(shard.q_rows.start, shard.q_rows.stop), slice(shard.kv_rows.start, shard.kv_rows.stop)

        def put(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.contiguous().to(device=device, dtype=dtype), requires_grad=False)

        self.qkv_proj = put(torch.cat([take(prefix + "q_proj.weight", (cfg.q_size, h))[q],
                                       take(prefix + "k_proj.weight", (cfg.kv_size, h))[kv],
                                       take(prefix + "v_proj.weight", (cfg.kv_size, h))[kv]]))  # q | k | v
        self.q_norm = put(take(prefix + "q_norm.weight", (cfg.head_dim,)))
        self.k_norm = put(take(prefix + "k_norm.weight", (cfg.head_dim,)))
        self.o_proj = put(take(prefix + "o_proj.weight", (h, cfg.q_size))[:, q])
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                backend: AttentionBackend, metadata: object) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normed) -> ``[T, hidden]``; writes K/V into ``layer_kv``
        (``[2, num_pages, page_size, num_kv_heads, head_dim]``)."""
        n, d = x.shape[0], self.head_dim
        q, k, v = F.linear(x, self.qkv_proj).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = F.rms_norm(q.view(n, self.heads, d), (d,), self.q_norm, self.eps)
        k = F.rms_norm(k.view(n, self.kv_heads, d), (d,), self.k_norm, self.eps)
        attn = backend.forward(apply_rope(q, cos, sin), apply_rope(k, cos, sin),
                               v.reshape(n, self.kv_heads, d), layer_kv, metadata, self.scale)
        return F.linear(attn, self.o_proj)


def build_qwen3_moe(config: ModelConfig, tensors: CheckpointTensors, dtype: torch.dtype,
                    device: torch.device, dispatcher: TokenDispatcher | None = None,
                    shard: RankShard | None = None) -> MoEDecoderLM:
    """The model of a ``qwen3_moe`` config (a rank's ``shard`` of it; None: whole), weights from ``tensors``.
    Raises ``ModelLoadError`` for a tensor missing, misshapen or unexpected; ``ValueError`` from the
    backend's ``bind``."""
    shard = shard if shard is not None else whole_model(config)
    backend = select_backend(device, dtype)
    backend.bind(shard.num_heads, shard.num_kv_heads, config.head_dim, dtype)

    def attention(cfg: ModelConfig, take: Take, prefix: str, dtype: torch.dtype,
                  device: torch.device) -> QKNormAttention:
        return QKNormAttention(cfg, take, prefix, dtype, device, shard)

    return MoEDecoderLM(config, tensors, attention, config.head_dim, backend, dtype, device, dispatcher,
                        shard)
