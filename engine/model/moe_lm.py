"""The decoder shared by the MoE architectures (``deepseek_v3``, ``qwen3_moe``), and ``build_moe_model``.

Per layer ``x + Attn(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))``, the FFN a dense SwiGLU or an ``MoEBlock``
(``MoEConfig.sparse_layers``); a final RMSNorm and the LM head (optionally tied). Each architecture supplies
its attention module (``attention(cfg, take, prefix, ...)``) and RoPE width; the forward follows
``LlamaForCausalLM.forward``'s contract (``engine.model_runner.CausalLM``), so the engine, the paged KV pool
and prefill/decode roles are unchanged.

Expert parallelism (``expert_parallel_size`` N > 1, docs/moe.md): each of the N ranks holds
``num_experts / N`` experts and a tensor-parallel slice of the rest (attention heads, dense layers' columns,
LM head rows: ``engine.parallel.layout.RankShard``; attention TP size = EP size, as SGLang runs EP). Per
layer: attention, its partial sums all-reduced, so every rank holds every token's hidden state; a dense FFN
likewise; an MoE FFN runs on this rank's contiguous share of the step's tokens (``split_range``: SGLang's
"scattered" MoE input), routed through the dispatcher (``SharedMemoryDispatcher`` between CPU ranks of one
host, ``AllToAllDispatcher`` over the process group otherwise) to the experts' ranks and back, shared
experts on the same share (every rank routes every token, a ``[T, E]`` product, so the counts each rank
receives are known without an exchange); then the shares are put back together with one all-reduce of a
``[T, hidden]`` tensor zero outside each rank's rows (exact: adding zeros changes no bit). The logits are
gathered to rank 0 as the Llama TP model's are.

DP attention (``RankShard.dp_attention``, docs/parallelism.md): every rank holds every attention head and runs
attention on its own requests' tokens (``ForwardBatch.dp``) over its own KV pool, with no exchange; an MoE
layer routes those tokens to the experts' ranks through the dispatcher (shared experts whole on every rank);
a dense layer's SwiGLU stays split by columns over every rank's tokens (``engine.parallel.dp``), each rank
keeping its own rows; the LM head's rows are split as above, over every rank's logits rows.

Weights: the full precision tensors of a Hugging Face folder (transformers' names), held in the model dtype;
``weight_quant`` other than ``"none"`` and tensor parallelism without expert parallelism are refused at
load. Tensors of layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer,
``num_nextn_predict_layers``) are ignored; any other tensor left over fails the load, named.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.forward_batch import DPShares, ForwardBatch
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.moe import DenseMLP, MoEBlock
from engine.model.moe_dispatch import TokenDispatcher
from engine.model.rope import RotaryEmbedding
from engine.parallel.communicator import Communicator
from engine.parallel.dp import gather_rows, gather_tokens, keep_own_rows
from engine.parallel.layout import (
    RankShard,
    check_tensor_parallel_size,
    dp_attention_shard,
    shard_for,
    split_range,
    whole_model,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointTensors:
    """A checkpoint's tensors by Hugging Face name, each taken once with its shape checked.

    Args:
        tensors: every tensor of the folder (``hf_folder.read_safetensors``).
        source: the file or folder, named in errors.
        num_layers: the model's layers; tensors of later layers (multi-token prediction) are not expected.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], source: str | None, num_layers: int) -> None:
        self.tensors = tensors
        self.source = source
        self.num_layers = num_layers
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``. Raises ModelLoadError when it is absent or not of ``shape``."""
        if name not in self.tensors:
            raise ModelLoadError(self.source, f"missing tensor {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(self.source,
                                 f"shape mismatch for {name!r}: expected {shape}, got {tuple(t.shape)}")
        self.used.add(name)
        return t

    def held_elsewhere(self, names: list[str]) -> None:
        """Count ``names`` as taken without reading them: another rank holds them (expert parallelism). The
        file is memory-mapped, so their bytes are never read here."""
        self.used.update(n for n in names if n in self.tensors)

    def check_all_used(self, architecture: str) -> None:
        """Raise ModelLoadError naming the first tensor no part of the model took (bar the ignored ones)."""
        def ignored(name: str) -> bool:
            layer = _LAYER.match(name)
            past_last = layer is not None and int(layer[1]) >= self.num_layers
            return name.endswith(_IGNORED_SUFFIXES) or past_last

        extra = sorted(n for n in self.tensors if n not in self.used and not ignored(n))
        if extra:
            raise ModelLoadError(self.source, f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in "
                                              f"all) for architecture {architecture!r}")


#: ``attention(cfg, take, prefix, dtype, device) -> module`` whose forward is
#: ``(x, cos, sin, layer_kv, backend, metadata) -> [T, hidden]``
AttentionFactory = Callable[..., nn.Module]


class RankLink:
    """How a layer of an expert-parallel model reaches its peers: this rank, the group's size and the
    communicator (set by ``MoEDecoderLM.attach`` before the first step; None on a single rank)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.comm: Communicator | None = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (in place; ``Communicator.all_reduce``), or ``x`` on a single rank.
        Raises ``CollectiveError``."""
        return x if self.comm is None else self.comm.all_reduce(x.contiguous())

    def shares(self, num_tokens: int) -> list[range]:
        """Every rank's share of a step's ``num_tokens`` tokens for the MoE, in rank order (contiguous,
        sizes within one, the shorter first)."""
        return [split_range(num_tokens, self.world_size, r) for r in range(self.world_size)]


class MoEDecoderLayer(nn.Module):
    """One block: attention and a dense or MoE feed-forward, each after its RMSNorm, each residual; across
    ranks as the module docstring says."""

    def __init__(self, cfg: ModelConfig, i: int, attention: nn.Module, ffn: nn.Module,
                 input_norm: torch.Tensor, post_norm: torch.Tensor, link: RankLink) -> None:
        super().__init__()
        self.eps, self.hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.attn, self.ffn = attention, ffn
        self.input_norm = nn.Parameter(input_norm, requires_grad=False)
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)
        self.link = link

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                backend: AttentionBackend, metadata: object, dp: DPShares | None = None) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; writes this layer's KV into ``layer_kv``. With ``dp``: ``T`` is
        this rank's own tokens (DP attention, module docstring).

        Raises:
            CollectiveError, DispatchError: an exchange with the other ranks failed (``ep > 1``).
        """
        if dp is not None:
            return self._forward_dp(h, cos, sin, layer_kv, backend, metadata, dp)
        x = F.rms_norm(h, (self.hidden,), self.input_norm, self.eps)
        h = h + self.link.reduce(self.attn(x, cos, sin, layer_kv, backend, metadata))
        x = F.rms_norm(h, (self.hidden,), self.post_norm, self.eps)
        if not isinstance(self.ffn, MoEBlock) or self.link.world_size == 1:
            return h + self.link.reduce(self.ffn(x))
        shares = self.link.shares(x.shape[0])
        rows = shares[self.link.rank]
        y = torch.zeros_like(x)   # [T, hidden]: this rank's rows filled, zero elsewhere, then summed
        y[rows.start:rows.stop] = self.ffn(x, shares)
        return h + self.link.reduce(y)

    def _forward_dp(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                    backend: AttentionBackend, metadata: object, dp: DPShares) -> torch.Tensor:
        comm = self.link.comm
        assert comm is not None, "DP attention needs the rank group's communicator"
        if h.shape[0]:   # an idle rank has no attention to run
            x = F.rms_norm(h, (self.hidden,), self.input_norm, self.eps)
            h = h + self.attn(x, cos, sin, layer_kv, backend, metadata)
        x = F.rms_norm(h, (self.hidden,), self.post_norm, self.eps)
        if isinstance(self.ffn, MoEBlock):   # own tokens to the experts' ranks and back (an idle rank too)
            return h + self.ffn(x)
        return h + keep_own_rows(comm, self.ffn(gather_tokens(comm, x, dp)), dp)


class MoEDecoderLM(nn.Module):
    """A DeepSeek-V3 or Qwen3-MoE model, its weights taken from ``tensors`` at construction.

    Args:
        config: the model (``config.moe`` set).
        tensors: the checkpoint (every tensor must be taken: ``CheckpointTensors.check_all_used``).
        attention: the architecture's attention module factory.
        rope_dim: the rotated width (MLA: ``qk_rope_head_dim``; GQA: ``head_dim``).
        backend: the paged attention backend (bound by the caller).
        dtype, device: weights and activations.
        dispatcher: the MoE layers' ``TokenDispatcher`` (one for all layers); None: every expert local.
        shard: this rank's tensor-parallel slice (dense columns, LM head rows; the attention factory takes
            its heads); None: the whole model. Its ``world_size`` must be the dispatcher's ``ep_size``.

    Attributes:
        shard: as given (``whole_model`` when None); the rank process sizes its KV pool from it.

    Raises:
        ModelLoadError: a tensor missing, misshapen or unexpected.
    """

    def __init__(self, config: ModelConfig, tensors: CheckpointTensors, attention: AttentionFactory,
                 rope_dim: int, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 dispatcher: TokenDispatcher | None = None, shard: RankShard | None = None) -> None:
        super().__init__()
        assert config.moe is not None
        self.config, self.dtype, self.attention_backend = config, dtype, backend
        self.shard = shard = shard if shard is not None else whole_model(config)
        assert dispatcher is None or dispatcher.ep_size == shard.world_size, "one rank group for EP and TP"
        self.link = RankLink(shard.rank, shard.world_size)
        h, take = config.hidden_size, tensors.take

        def put(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return take(name, shape).to(device=device, dtype=dtype)

        self.embed_tokens = nn.Parameter(put("model.embed_tokens.weight", (config.vocab_size, h)),
                                         requires_grad=False)
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            ffn: nn.Module = MoEBlock(config.moe, take, p + "mlp.", h, dtype, device, dispatcher) \
                if i in config.moe.sparse_layers else \
                DenseMLP(take, p + "mlp.", h, config.intermediate_size, dtype, device, shard.intermediate)
            if isinstance(ffn, MoEBlock):
                others = [e for e in range(config.moe.num_experts) if e not in ffn.dispatcher.local_experts]
                tensors.held_elsewhere([f"{p}mlp.experts.{e}.{w}_proj.weight" for e in others
                                        for w in ("gate", "up", "down")])
            layers.append(MoEDecoderLayer(config, i, attention(config, take, p + "self_attn.", dtype, device),
                                          ffn, put(p + "input_layernorm.weight", (h,)),
                                          put(p + "post_attention_layernorm.weight", (h,)), self.link))
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(put("model.norm.weight", (h,)), requires_grad=False)
        vocab = slice(shard.vocab.start, shard.vocab.stop)   # this rank's LM head rows (all on one rank)
        if config.tie_word_embeddings:
            tensors.used.add("lm_head.weight")   # some checkpoints store the tied copy
            self.lm_head = self.embed_tokens if shard.is_whole else \
                nn.Parameter(self.embed_tokens[vocab].clone(), requires_grad=False)
        else:
            self.lm_head = nn.Parameter(put("lm_head.weight", (config.vocab_size, h))[vocab].contiguous(),
                                        requires_grad=False)
        tensors.check_all_used(config.architecture)
        self.rotary = RotaryEmbedding(rope_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling).to(device)

    def attach(self, comm: Communicator) -> None:
        """Sum partial products, put the MoE shares together and gather the logits through ``comm`` from the
        next forward on (called once by the rank group, before the first step; every rank)."""
        self.link.comm = comm

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """One step: ``LlamaForCausalLM.forward``'s contract. ``kv_cache``: ``[num_layers, num_planes,
        num_pages, page_size, num_kv_heads, head_dim]`` (MLA: 1 plane, 1 head of the latent width).

        Returns:
            ``[len(batch.logits_indices), vocab_size]`` float32 logits (on ranks other than 0 of an
            expert-parallel group: this rank's vocabulary columns only); with ``batch.dp``, the rows of every
            rank's batch, ranks in order.

        Raises:
            engine.model.moe_dispatch.DispatchError, engine.parallel.communicator.CollectiveError: an
                expert-parallel exchange failed.
        """
        cfg = self.config
        metadata = self.attention_backend.prepare(batch, int(kv_cache.shape[3]))
        h = F.embedding(batch.input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(batch.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], self.attention_backend, metadata, batch.dp)
        h = h[batch.logits_indices]
        if batch.dp is not None:   # the LM head's rows are split: every rank's logits rows, ranks in order
            assert self.link.comm is not None
            h = gather_rows(self.link.comm, h, batch.dp.logits_counts, batch.dp.rank)
            if not h.shape[0]:
                return h.new_zeros(0, cfg.vocab_size, dtype=torch.float32)
        h = F.rms_norm(h, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        logits = F.linear(h, self.lm_head).float()
        return logits if self.link.comm is None else self.link.comm.gather_logits(logits.contiguous())


def check_expert_parallel_size(config: ModelConfig, ep: int, dp_attention: bool = False) -> None:
    """Raise ValueError, naming ``expert_parallel_size``, when the model cannot run over ``ep`` ranks: not
    an MoE model, experts or attention heads not divisible by ``ep`` (the attention is tensor-parallel over
    the same ranks; with ``dp_attention`` every rank holds every head, so only the experts count)."""
    if ep == 1:
        return
    if config.moe is None:
        raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; "
                         f"{config.architecture!r} has no routed experts")
    if config.moe.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide the model's {config.moe.num_experts} "
                         "routed experts (n_routed_experts / num_experts)")
    if dp_attention:
        return
    try:
        check_tensor_parallel_size(config, ep)
    except ValueError:
        raise ValueError(f"expert_parallel_size={ep} does not fit the model's {config.num_heads} attention "
                         f"heads and {config.num_kv_heads} KV heads (attention is split over the same ranks)"
                         ) from None


def build_moe_model(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str | None,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    weight_quant: str = "none", tensor_parallel_size: int = 1,
                    dispatcher: TokenDispatcher | None = None, rank: int = 0,
                    dp_attention: bool = False) -> MoEDecoderLM:
    """The model of a ``deepseek_v3`` or ``qwen3_moe`` config, its weights from ``tensors`` (eval mode): the
    whole model, or with an expert-parallel ``dispatcher`` (``ep_size`` N > 1) rank ``rank``'s share: its
    experts (``dispatcher.local_experts``) and its tensor-parallel slice of the rest (``shard_for(config,
    rank, N)``; with ``dp_attention`` every attention head instead: ``dp_attention_shard``). The rank's
    weights only are copied into its parameters.

    Raises:
        ValueError: ``weight_quant`` other than ``"none"``, ``tensor_parallel_size`` > 1 (named; not
            supported for these architectures: use ``expert_parallel_size``), or a dispatcher's ``ep_size``
            the model cannot take (``check_expert_parallel_size``).
        ModelLoadError: a tensor missing, misshapen or unexpected.
    """
    arch = config.architecture
    if weight_quant != "none":
        raise ValueError(f"weight_quant={weight_quant!r} is not supported for {arch} (only 'none')")
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not supported for {arch} (only 1; "
                         "expert_parallel_size splits these models over ranks)")
    ep = dispatcher.ep_size if dispatcher is not None else 1
    check_expert_parallel_size(config, ep, dp_attention)
    shard = dp_attention_shard(config, rank, ep) if dp_attention and ep > 1 else shard_for(config, rank, ep)
    device = torch.device(device)
    checkpoint = CheckpointTensors(tensors, source, config.num_layers)
    if arch == "deepseek_v3":
        from engine.model.deepseek_v3 import build_deepseek_v3

        model = build_deepseek_v3(config, checkpoint, dtype, device, dispatcher, shard)
    elif arch == "qwen3_moe":
        from engine.model.qwen3_moe import build_qwen3_moe

        model = build_qwen3_moe(config, checkpoint, dtype, device, dispatcher, shard)
    else:
        raise ValueError(f"architecture {arch!r} is not a mixture-of-experts model")
    return model.eval()
