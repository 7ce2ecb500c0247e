"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, for inference only.

Architecture (Touvron et al. 2023, "LLaMA"; HF ``modeling_llama`` naming): token embedding; per layer
``x + Attn(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))``; final RMSNorm; LM head (optionally tied to the
embedding). Attention uses RoPE (``rope.py``) and grouped-query heads (Ainslie et al. 2023) through an
``AttentionBackend``; the MLP is SwiGLU (Shazeer 2020): ``down(silu(gate(x)) * up(x))``. For speed, q/k/v are
one matmul and gate/up are one matmul; ``load_weights`` concatenates the HF tensors accordingly. With
``weight_quant="int8"`` the five products per layer and the LM head hold ``linear.Int8Weight``s instead.

Tensor parallelism (``engine/parallel``): built with a ``RankShard`` the model holds one rank's slice (its
query and KV heads, MLP columns and LM head rows; ``engine.parallel.layout``); once a ``Communicator`` is
attached, the outputs of o_proj and down_proj are summed over the ranks (row-parallel) and the logits gathered
on rank 0 (vocabulary-parallel). Without a shard (one rank) nothing changes.

DP attention (``RankShard.dp_attention``, docs/parallelism.md): the shard holds every head, and each rank's
batch is its own requests' (``ForwardBatch.dp``): attention runs on them alone, with no exchange; the MLP and
the LM head stay split by columns / rows, so their input is every rank's tokens (``engine.parallel.dp``) and
each rank keeps its own rows of the MLP's summed output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.forward_batch import DPShares, ForwardBatch
from engine.model.config import ModelConfig
from engine.model.linear import WEIGHT_QUANTS, Int8Weight, Weight, embedding, linear, weight_bytes
from engine.model.rope import RotaryEmbedding, apply_rope
from engine.parallel.dp import gather_rows, gather_tokens, keep_own_rows
from engine.parallel.layout import RankShard, whole_model

if TYPE_CHECKING:
    from engine.parallel.communicator import Communicator


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory); ``load_weights`` replaces it with the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    """One transformer block; parameters in the fused layout (``qkv_proj``, ``gate_up_proj``), holding the
    heads and MLP columns of ``shard`` (all of them on a single rank)."""

    def __init__(self, cfg: ModelConfig, shard: RankShard) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        h, q_size, kv_size = cfg.hidden_size, len(shard.q_rows), len(shard.kv_rows)
        inter = len(shard.intermediate)
        self.input_norm = _param(h)
        self.qkv_proj = _param(q_size + 2 * kv_size, h)  # rows: q | k | v
        self.qkv_bias = _param(q_size + 2 * kv_size) if cfg.attention_bias else None
        self.o_proj = _param(h, q_size)
        self.post_norm = _param(h)
        self.gate_up_proj = _param(2 * inter, h)  # rows: gate | up
        self.down_proj = _param(h, inter)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                backend: AttentionBackend, metadata: object,
                comm: Communicator | None = None, dp: DPShares | None = None) -> torch.Tensor:
        """``h`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``; writes this layer's K/V into
        ``layer_kv``; with ``comm``, sums the row-parallel products over the ranks; with ``dp`` (and
        ``comm``), attention is this rank's alone and the MLP runs on every rank's tokens (module
        docstring)."""
        cfg = self.cfg
        if dp is not None:
            assert comm is not None
            if h.shape[0]:   # an idle rank has no attention to run
                h = h + self._attention(h, cos, sin, layer_kv, backend, metadata)
            x = F.rms_norm(h, (cfg.hidden_size,), self.post_norm, cfg.rms_norm_eps)
            return h + keep_own_rows(comm, self._mlp(gather_tokens(comm, x, dp)), dp)
        out = self._attention(h, cos, sin, layer_kv, backend, metadata)
        h = h + (out if comm is None else comm.all_reduce(out))
        x = F.rms_norm(h, (cfg.hidden_size,), self.post_norm, cfg.rms_norm_eps)
        out = self._mlp(x)
        return h + (out if comm is None else comm.all_reduce(out))

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                   backend: AttentionBackend, metadata: object) -> torch.Tensor:
        """``[n, hidden]`` -> o_proj's output ``[n, hidden]`` (a partial sum on a tensor-parallel rank)."""
        cfg = self.cfg
        n, heads, kv_heads = h.shape[0], self.num_heads, self.num_kv_heads
        x = F.rms_norm(h, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        qk_width = (heads + kv_heads) * cfg.head_dim
        qk = qkv[:, :qk_width].view(n, heads + kv_heads, cfg.head_dim)
        q, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)
        v = qkv[:, qk_width:].view(n, kv_heads, cfg.head_dim)
        attn = backend.forward(q, k, v, layer_kv, metadata, self.scale)
        return linear(attn, self.o_proj)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (normed) -> down_proj's output ``[n, hidden]`` (a partial sum when split)."""
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    """The model. Build it, then ``load_weights``; until then its parameters are meta placeholders.

    Args:
        config: the model's shapes.
        attention_backend: paged attention implementation; the CPU torch backend when omitted.
        dtype, device: where ``load_weights`` puts the parameters (fp32 / CPU by default); activations and the
            KV cache use ``dtype`` too.
        weight_quant: ``"none"`` or ``"int8"`` (``linear.WEIGHT_QUANTS``): the format ``load_weights`` gives
            the linear layers and the LM head.
        shard: the tensor-parallel rank's slice to hold (``engine.parallel.layout.shard_for``); None: the
            whole model. ``load_weights`` takes the full HF tensors and keeps this slice of them.

    Attributes:
        shard: the ``RankShard`` held.
        comm: the rank group's ``Communicator`` (``attach``), None on a single rank.

    Raises:
        ValueError: ``weight_quant`` is not one of ``WEIGHT_QUANTS``.
    """

    embed_tokens: torch.Tensor | Int8Weight   # [vocab, hidden]: a Parameter until loaded
    lm_head: Weight   # [vocab rows of this rank, hidden]; the embedding itself when tied and whole

    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 weight_quant: str = "none", shard: RankShard | None = None) -> None:
        super().__init__()
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {weight_quant!r}")
        self.config = config
        self.dtype = dtype
        self.weight_quant = weight_quant
        self.device = torch.device(device)
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.shard = shard if shard is not None else whole_model(config)
        self.comm: Communicator | None = None
        self.attention_backend.bind(self.shard.num_heads, self.shard.num_kv_heads, config.head_dim, dtype)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.shard) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size)
        tied_whole = config.tie_word_embeddings and self.shard.is_whole
        self.lm_head = self.embed_tokens if tied_whole else _param(len(self.shard.vocab), config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.rotary = rotary.to(device)

    def attach(self, comm: Communicator) -> None:
        """Sum the row-parallel products and gather the logits through ``comm`` from the next forward on
        (called once by the rank group, before the first step)."""
        self.comm = comm

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step and return next-token logits.

        Args:
            batch: token ids, positions, slot mapping, page tables of this step (same device as the model).
            kv_cache: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``, model dtype; this
                step's K/V are written into it at ``batch.slot_mapping`` (``num_kv_heads``: this rank's).

        Returns:
            ``[len(batch.logits_indices), vocab_size]`` float32 logits of the rows ``batch.logits_indices``
            (on ranks other than 0 of a group: this rank's ``[.., len(shard.vocab)]`` columns only). With
            ``batch.dp``: the rows of every rank's batch, ranks in order (``sum(batch.dp.logits_counts)``).

        Raises:
            engine.parallel.communicator.CollectiveError: a collective of the rank group failed.
        """
        cfg = self.config
        metadata = self.attention_backend.prepare(batch, int(kv_cache.shape[3]))
        h = embedding(batch.input_ids, self.embed_tokens, self.dtype)
        cos, sin = self.rotary.tables(batch.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], self.attention_backend, metadata, self.comm, batch.dp)
        h = h[batch.logits_indices]
        if batch.dp is not None:   # the LM head's rows are split: every rank's logits rows, ranks in order
            assert self.comm is not None
            h = gather_rows(self.comm, h, batch.dp.logits_counts, batch.dp.rank)
            if not h.shape[0]:
                return h.new_zeros(0, self.config.vocab_size, dtype=torch.float32)
        h = F.rms_norm(h, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        logits = linear(h, self.lm_head).float()
        return logits if self.comm is None else self.comm.gather_logits(logits)

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
