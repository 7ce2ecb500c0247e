"""Map Hugging Face tensor names onto ``LlamaForCausalLM``'s fused parameters, with shape checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.linear import Int8Weight, PackedBF16Weight
from engine.model.safetensors_io import adjacent_view

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMapper:
    """Takes tensors out of an HF state dict by name, checking each shape against the config.

    Every name taken is recorded; names left over at the end are reported as unexpected. With
    ``weight_quant="int8"`` the products' weights and the LM head (with a tied embedding) become
    ``Int8Weight``s, quantized from the float tensors here; in bfloat16 on a CPU with AVX512_BF16 and no AMX
    they become ``PackedBF16Weight``s (``linear._pack_bf16_here``; a tied LM head then is a packed copy of the
    embedding, which lookups still read plain: +vocab x hidden x 2 bytes).

    A model that holds one tensor-parallel rank's slice (``model.shard``) gets that slice of each full tensor:
    rows of q/k/v, gate/up and the LM head, columns of o_proj and down_proj (copied contiguous); each slice
    is then converted (int8, packed bf16) like a whole tensor, so every weight format shards. The embedding
    stays whole; a tied LM head is its vocabulary rows.
    """

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], source: str | None,
                 dtype: torch.dtype, device: torch.device, weight_quant: str = "none") -> None:
        self.cfg = cfg
        self.quantize = weight_quant == "int8"
        self.dtype = dtype
        self.device = device
        self.tensors = state_dict
        self.source = source
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``; raises ModelLoadError when absent or not of ``shape``."""
        if name not in self.tensors:
            raise ModelLoadError(self.source, f"missing tensor {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(self.source,
                                 f"shape mismatch for {name!r}: expected {shape}, got {tuple(t.shape)}")
        self.used.add(name)
        return t

    def _set(self, module: torch.nn.Module, attr: str, parts: list[torch.Tensor],
             product: bool = False) -> None:
        """Make ``module.attr`` the concatenation of ``parts``, in the model's dtype/device; no copy when
        the parts are adjacent in memory and already of that dtype/device. A ``product`` weight becomes an
        ``Int8Weight`` when quantizing."""
        joined = adjacent_view(parts) if len(parts) > 1 else parts[0]
        if joined is None:
            joined = torch.cat(parts, dim=0)
        if product and self.quantize:
            delattr(module, attr)  # a registered Parameter cannot be replaced by a module in place
            setattr(module, attr, Int8Weight.quantize(joined.to(device=self.device)))
            return
        tensor = joined.to(device=self.device, dtype=self.dtype)
        if self.quantize and tensor.data_ptr() == joined.data_ptr():
            tensor = tensor.clone()  # a view would keep the whole float file mapped and resident
        if self.dtype == torch.bfloat16 and tensor.dim() == 2:
            tensor = tensor.contiguous()  # the bf16 decode kernel reads rows back to back
        packed = self._packed(tensor) if product and attr != "embed_tokens" else None
        if packed is not None:
            delattr(module, attr)
            setattr(module, attr, packed)
            return
        setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))

    def _packed(self, tensor: torch.Tensor) -> PackedBF16Weight | None:
        """A bf16 product weight prepacked for oneDNN, or None (int8, or what ``PackedBF16Weight.pack``
        refuses: another dtype or device, no native bf16 matmul here)."""
        return None if self.quantize else PackedBF16Weight.pack(tensor)

    def _layer(self, model: LlamaForCausalLM, i: int) -> None:
        c, shard = self.cfg, model.shard
        h, p = c.hidden_size, f"model.layers.{i}."
        layer = model.layers[i]
        q, kv, inter = shard.q_rows, shard.kv_rows, shard.intermediate
        self._set(layer, "input_norm", [self.take(p + "input_layernorm.weight", (h,))])
        self._set(layer, "post_norm", [self.take(p + "post_attention_layernorm.weight", (h,))])
        self._set(layer, "qkv_proj", [self.take(p + "self_attn.q_proj.weight", (c.q_size, h))[_rows(q)],
                                      self.take(p + "self_attn.k_proj.weight", (c.kv_size, h))[_rows(kv)],
                                      self.take(p + "self_attn.v_proj.weight", (c.kv_size, h))[_rows(kv)]],
                  True)
        if layer.qkv_bias is not None:
            self._set(layer, "qkv_bias", [self.take(p + "self_attn.q_proj.bias", (c.q_size,))[_rows(q)],
                                          self.take(p + "self_attn.k_proj.bias", (c.kv_size,))[_rows(kv)],
                                          self.take(p + "self_attn.v_proj.bias", (c.kv_size,))[_rows(kv)]])
        self._set(layer, "o_proj", [_columns(self.take(p + "self_attn.o_proj.weight", (h, c.q_size)), q)],
                  True)
        self._set(layer, "gate_up_proj",
                  [self.take(p + "mlp.gate_proj.weight", (c.intermediate_size, h))[_rows(inter)],
                   self.take(p + "mlp.up_proj.weight", (c.intermediate_size, h))[_rows(inter)]], True)
        self._set(layer, "down_proj",
                  [_columns(self.take(p + "mlp.down_proj.weight", (h, c.intermediate_size)), inter)], True)

    def load_into(self, model: LlamaForCausalLM) -> None:
        """Set every parameter of ``model`` (views of the given tensors when dtype/device allow); raises
        ModelLoadError on a missing, misshapen or unknown tensor."""
        c = self.cfg
        vocab_shape = (c.vocab_size, c.hidden_size)
        whole = model.shard.is_whole
        embed = self.take("model.embed_tokens.weight", vocab_shape)
        self._set(model, "embed_tokens", [embed], c.tie_word_embeddings)
        for i in range(c.num_layers):
            self._layer(model, i)
        self._set(model, "norm", [self.take("model.norm.weight", (c.hidden_size,))])
        if not whole:   # the LM head's vocabulary rows of this rank (of the embedding when tied)
            head = embed if c.tie_word_embeddings else self.take("lm_head.weight", vocab_shape)
            self._set(model, "lm_head", [head[_rows(model.shard.vocab)]], True)
            self.used.add("lm_head.weight")
        elif c.tie_word_embeddings:
            packed = None if isinstance(model.embed_tokens, Int8Weight) else self._packed(model.embed_tokens)
            if isinstance(model.embed_tokens, Int8Weight) or packed is not None:
                delattr(model, "lm_head")  # the placeholder Parameter: a module cannot replace it in place
            model.lm_head = packed if packed is not None else model.embed_tokens
            self.used.add("lm_head.weight")  # some checkpoints store the tied copy; it is not needed
        else:
            self._set(model, "lm_head", [self.take("lm_head.weight", vocab_shape)], True)
        extra = sorted(n for n in self.tensors if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))
        if extra:
            raise ModelLoadError(self.source, f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in "
                                              f"all) for architecture {c.architecture!r}")


def _rows(held: range) -> slice:
    """The rows ``held`` of a weight (a view)."""
    return slice(held.start, held.stop)


def _columns(weight: torch.Tensor, held: range) -> torch.Tensor:
    """The columns ``held`` of a ``[N, K]`` weight: the weight itself when it holds them all, else a
    contiguous copy (the products' kernels read rows back to back)."""
    if held.start == 0 and held.stop == weight.shape[1]:
        return weight
    return weight[:, held.start:held.stop].contiguous()
