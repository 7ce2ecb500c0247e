"""``DeepseekV3ForCausalLM`` (DeepSeek-V3 technical report, arXiv:2412.19437; transformers'
``modeling_deepseek_v3``): MLA attention (``engine.model.mla``) with its latent KV cache, the first
``first_k_dense_replace`` layers dense SwiGLUs, the rest MoE blocks with shared experts and sigmoid,
group-limited routing biased by ``e_score_correction_bias`` (``engine.model.moe``, ``moe_routing``).

Attention always runs on the torch backend (``TorchAttentionBackend.forward_latent``): the flashinfer backend
has no MLA path here.
"""

from __future__ import annotations

import torch

from engine.attention import TorchAttentionBackend
from engine.model.config import ModelConfig
from engine.model.mla import MLAAttention
from engine.model.moe import Take
from engine.model.moe_dispatch import TokenDispatcher
from engine.model.moe_lm import CheckpointTensors, MoEDecoderLM
from engine.parallel.layout import RankShard, whole_model


def build_deepseek_v3(config: ModelConfig, tensors: CheckpointTensors, dtype: torch.dtype,
                      device: torch.device, dispatcher: TokenDispatcher | None = None,
                      shard: RankShard | None = None) -> MoEDecoderLM:
    """The model of a ``deepseek_v3`` config (``config.mla`` and ``config.moe`` set; a rank's ``shard`` of it:
    its query heads, the whole latent; None: whole), weights from ``tensors``. Raises ``ModelLoadError`` for
    a tensor missing, misshapen or unexpected."""
    assert config.mla is not None
    shard = shard if shard is not None else whole_model(config)

    def attention(cfg: ModelConfig, take: Take, prefix: str, dtype: torch.dtype,
                  device: torch.device) -> MLAAttention:
        return MLAAttention(cfg, take, prefix, dtype, device, shard.heads)

    return MoEDecoderLM(config, tensors, attention, config.mla.qk_rope_head_dim, TorchAttentionBackend(),
                        dtype, device, dispatcher, shard)
