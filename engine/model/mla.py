"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3,
arXiv:2412.19437, section 2.1.1), over the paged KV pool's one latent plane, in the absorbed form.

Per token (transformers' ``DeepseekV3Attention`` names): the query is ``q_b_proj(RMSNorm(q_a_proj(x)))`` (or
``q_proj(x)`` without ``q_lora_rank``), per head ``q_nope`` (``qk_nope_head_dim``) | ``q_pe``
(``qk_rope_head_dim``); ``kv_a_proj_with_mqa(x)`` gives the latent ``c_kv`` (``kv_lora_rank``, normed by
``kv_a_layernorm``) and one RoPE key ``k_pe`` shared by every head. The cache holds ``c_kv | k_pe`` per token
and layer: ``kv_lora_rank + qk_rope_head_dim`` elements, one "head", no V. ``kv_b_proj`` splits per head into
``W_UK`` ``[qk_nope_head_dim, kv_lora_rank]`` and ``W_UV`` ``[v_head_dim, kv_lora_rank]``; instead of
expanding every cached latent into keys and values, the query is absorbed (``q_nope @ W_UK``, so a head's
score is ``(q_nope W_UK) . c_kv + q_pe . k_pe``) and the output un-absorbed (``(softmax @ c_kv) @ W_UV^T``):
equal to the expanded form in exact arithmetic, and it reads the latent once per head group (MQA over the
latent: ``AttentionBackend.forward_latent``). Scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
with YaRN RoPE scaling multiplied by ``mscale(factor, mscale_all_dim) ** 2`` as transformers'
``DeepseekV3Attention`` does (``rope_scaling.mla_softmax_scale_factor``; the cos/sin of ``q_pe`` and ``k_pe``
carry YaRN's attention factor, ``rope.RotaryEmbedding``).

``rope_interleave`` (DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ..``): the rows of
``q_pe`` in ``q_b_proj`` and of ``k_pe`` in ``kv_a_proj_with_mqa`` are permuted at load (evens, then odds),
after which the usual rotate-half RoPE gives transformers' ``apply_rotary_pos_emb_interleave`` bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.moe import Take
from engine.model.rope import apply_rope
from engine.model.rope_scaling import mla_softmax_scale_factor

#: transformers' ``DeepseekV3RMSNorm`` default: ``q_a_layernorm`` and ``kv_a_layernorm`` do not take
#: ``rms_norm_eps``
_LORA_NORM_EPS = 1e-6


def _deinterleave(weight: torch.Tensor, start: int, width: int, period: int) -> torch.Tensor:
    """``weight`` ``[rows, in]`` with rows ``[start, start + width)`` of every block of ``period`` rows
    reordered evens then odds (a copy)."""
    rows = torch.arange(weight.shape[0]).view(-1, period)
    rope = rows[:, start:start + width]
    rows[:, start:start + width] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return weight[rows.reshape(-1)]


class MLAAttention(nn.Module):
    """One layer's MLA, holding its weights (fp32 or the model dtype).

    Args:
        cfg: the model (``cfg.mla`` set).
        take, prefix: the checkpoint's tensors; ``"model.layers.N.self_attn."``.
        dtype, device: where the weights go.
        heads: the query heads held (a tensor-parallel rank's: its rows of ``q_b_proj`` / ``kv_b_proj`` and
            columns of ``o_proj``, so its output is a partial sum the caller all-reduces; the latent
            projection ``kv_a_proj_with_mqa`` is whole on every rank, each holding the whole latent KV, as in
            SGLang's MLA under tensor parallelism); None: every head.

    Attributes:
        w_uk: ``[num_heads, qk_nope_head_dim, kv_lora_rank]``; w_uv: ``[num_heads, v_head_dim, kv_lora_rank]``
            (views of ``kv_b_proj``; ``num_heads``: the heads held).

    Raises:
        ModelLoadError: from ``take``.
    """

    def __init__(self, cfg: ModelConfig, take: Take, prefix: str, dtype: torch.dtype,
                 device: torch.device, heads: range | None = None) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        heads = heads if heads is not None else range(cfg.num_heads)
        self.m, self.num_heads, h = m, len(heads), cfg.hidden_size
        q_rows = cfg.num_heads * m.qk_head_dim

        def rows(t: torch.Tensor, per_head: int) -> torch.Tensor:
            return t[heads.start * per_head:heads.stop * per_head]

        def put(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        def rope_rows(t: torch.Tensor, start: int, period: int) -> torch.Tensor:
            return _deinterleave(t, start, m.qk_rope_head_dim, period) if m.rope_interleave else t

        self.q_a = self.q_a_norm = None
        if m.q_lora_rank is None:
            q_b = take(prefix + "q_proj.weight", (q_rows, h))
        else:
            self.q_a = put(take(prefix + "q_a_proj.weight", (m.q_lora_rank, h)))
            self.q_a_norm = put(take(prefix + "q_a_layernorm.weight", (m.q_lora_rank,)))
            q_b = take(prefix + "q_b_proj.weight", (q_rows, m.q_lora_rank))
        self.q_b = put(rows(rope_rows(q_b, m.qk_nope_head_dim, m.qk_head_dim), m.qk_head_dim))
        kv_a = take(prefix + "kv_a_proj_with_mqa.weight", (m.latent_dim, h))
        self.kv_a = put(rope_rows(kv_a, m.kv_lora_rank, m.latent_dim))
        self.kv_a_norm = put(take(prefix + "kv_a_layernorm.weight", (m.kv_lora_rank,)))
        kv_b = take(prefix + "kv_b_proj.weight", (cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                  m.kv_lora_rank))
        # [num_heads * (nope + v), kv_lora_rank]
        self.kv_b = put(rows(kv_b, m.qk_nope_head_dim + m.v_head_dim))
        per_head = self.kv_b.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk, self.w_uv = per_head.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        o_proj = take(prefix + "o_proj.weight", (h, cfg.num_heads * m.v_head_dim))
        self.o_proj = put(o_proj[:, heads.start * m.v_head_dim:heads.stop * m.v_head_dim].contiguous())
        self.scale = m.qk_head_dim ** -0.5 * mla_softmax_scale_factor(cfg.rope_scaling)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                backend: AttentionBackend, metadata: object) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normed) -> ``[T, hidden]``; writes the tokens' latents into ``layer_kv``
        (``[1, num_pages, page_size, 1, latent_dim]``). ``cos``/``sin``: ``[T, 1, qk_rope_head_dim]``."""
        m, n, heads = self.m, x.shape[0], self.num_heads
        if self.q_a is None:
            q = F.linear(x, self.q_b)
        else:
            assert m.q_lora_rank is not None   # q_a exists exactly when the config has a q_lora_rank
            q_a = F.rms_norm(F.linear(x, self.q_a), (m.q_lora_rank,), self.q_a_norm, _LORA_NORM_EPS)
            q = F.linear(q_a, self.q_b)
        q_nope, q_pe = q.view(n, heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c_kv, k_pe = F.linear(x, self.kv_a).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c_kv = F.rms_norm(c_kv, (m.kv_lora_rank,), self.kv_a_norm, _LORA_NORM_EPS)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)   # [T, heads, kv_lora_rank]
        query = torch.cat([q_latent, apply_rope(q_pe, cos, sin)], dim=-1)   # [T, heads, latent_dim]
        latent = torch.cat([c_kv.unsqueeze(1), apply_rope(k_pe.unsqueeze(1), cos, sin)], dim=-1)  # [T, 1, D]
        out = backend.forward_latent(query, latent, layer_kv, metadata, self.scale, m.kv_lora_rank)
        out = torch.einsum("thc,hvc->thv", out.view(n, heads, m.kv_lora_rank), self.w_uv)
        return F.linear(out.reshape(n, heads * m.v_head_dim), self.o_proj)
