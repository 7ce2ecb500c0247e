"""The feed-forward blocks of the MoE architectures: a dense SwiGLU and the mixture-of-experts block.

``MoEBlock`` (DeepSeek-V3 report, arXiv:2412.19437, eq. 12-16; Qwen3-MoE): ``y = sum_k w_k * E_k(x) +
S(x)``, the routed experts ``E_k`` chosen by ``engine.model.moe_routing``, reached through a
``TokenDispatcher`` (``engine.model.moe_dispatch``: local at ``ep = 1``, all-to-all or DeepEP across ranks),
and the shared experts ``S`` (DeepSeek-V3; none in Qwen3-MoE) run on every token. Every expert is a SwiGLU
(Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate and up fused into one product.

Weights are loaded from the Hugging Face names of transformers' checkpoints (one tensor per expert:
``mlp.experts.{e}.gate_proj.weight``, ...); a rank holds only its dispatcher's ``local_experts``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.moe_config import MoEConfig
from engine.model.moe_dispatch import LocalDispatcher, TokenDispatcher
from engine.model.moe_routing import route

#: ``take(name, shape) -> tensor``: a checkpoint tensor by Hugging Face name, shape-checked (raises
#: ``ModelLoadError`` when absent or misshapen)
Take = Callable[[str, tuple[int, ...]], torch.Tensor]


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H]`` through one SwiGLU: ``gate_up`` ``[2I, H]`` (rows: gate | up), ``down`` ``[H, I]`` ->
    ``[T, H]``, dtype of ``x``."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class DenseMLP(nn.Module):
    """A SwiGLU of ``intermediate_size`` columns (dense layers, DeepSeek-V3's shared experts).

    Args:
        take: the checkpoint's tensors; prefix: e.g. ``"model.layers.0.mlp."``.
        hidden, intermediate: the SwiGLU's sizes.
        dtype, device: where the weights go.
        columns: the intermediate columns held (a tensor-parallel rank's: column-parallel gate/up,
            row-parallel down, so its output is a partial sum the caller all-reduces); None: all.
    """

    def __init__(self, take: Take, prefix: str, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device, columns: range | None = None) -> None:
        super().__init__()
        cols = slice(columns.start, columns.stop) if columns is not None else slice(None)
        gate = take(prefix + "gate_proj.weight", (intermediate, hidden))[cols]
        up = take(prefix + "up_proj.weight", (intermediate, hidden))[cols]
        self.gate_up = _param(torch.cat([gate, up]).to(device=device, dtype=dtype))   # [2I_local, H]
        down = take(prefix + "down_proj.weight", (hidden, intermediate))[:, cols]
        self.down = _param(down.contiguous().to(device=device, dtype=dtype))   # [H, I_local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return swiglu(x, self.gate_up, self.down)


class MoEBlock(nn.Module):
    """Router, this rank's routed experts and the shared experts of one MoE layer.

    Args:
        cfg: the routing and expert sizes.
        take, prefix: the checkpoint's tensors and the layer's MLP prefix (``"model.layers.3.mlp."``).
        hidden: the model's hidden size.
        dtype, device: where the weights go (the router's bias stays float32, as in transformers).
        dispatcher: how tokens reach the experts; ``LocalDispatcher`` (every expert here) when None.

    Attributes:
        gate: ``[E, H]`` router weight; bias: ``[E]`` float32 ``e_score_correction_bias`` or None.
        w13: ``[E_local, 2 * I, H]`` each local expert's gate | up; w2: ``[E_local, H, I]`` its down.
        shared: the shared experts' ``DenseMLP`` or None.

    Raises:
        ModelLoadError: from ``take``.
    """

    def __init__(self, cfg: MoEConfig, take: Take, prefix: str, hidden: int, dtype: torch.dtype,
                 device: torch.device, dispatcher: TokenDispatcher | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.dispatcher = dispatcher or LocalDispatcher(cfg.num_experts)
        e, i = cfg.num_experts, cfg.intermediate_size
        self.gate = _param(take(prefix + "gate.weight", (e, hidden)).to(device=device, dtype=dtype))
        self.bias = None
        if cfg.correction_bias:
            bias = take(prefix + "gate.e_score_correction_bias", (e,))
            self.bias = _param(bias.to(device=device, dtype=torch.float32))
        w13, w2 = [], []
        for j in self.dispatcher.local_experts:
            p = f"{prefix}experts.{j}."
            w13.append(torch.cat([take(p + "gate_proj.weight", (i, hidden)),
                                  take(p + "up_proj.weight", (i, hidden))]))
            w2.append(take(p + "down_proj.weight", (hidden, i)))
        self.w13 = _param(torch.stack(w13).to(device=device, dtype=dtype))
        self.w2 = _param(torch.stack(w2).to(device=device, dtype=dtype))
        self.shared = DenseMLP(take, prefix + "shared_experts.", hidden, i * cfg.num_shared_experts, dtype,
                               device) if cfg.num_shared_experts else None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, E]``: float32 for sigmoid routing (DeepSeek-V3 routes in fp32), else the model dtype."""
        if self.cfg.scoring_func == "sigmoid":
            return F.linear(x.float(), self.gate.float())
        return F.linear(x, self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]``: routed experts (dispatched, weighted, combined) plus shared ones.

        Raises:
            engine.model.moe_dispatch.DispatchError: the dispatcher's exchange failed (``ep > 1``).
        """
        routing = route(self.router_logits(x), self.cfg, self.bias)
        sent = self.dispatcher.dispatch(x, routing.topk_ids, routing.topk_weights)
        outputs = torch.empty_like(sent.hidden)
        for j, start, stop in sent.expert_blocks():   # one product per block of one expert's rows
            if stop > start:
                outputs[start:stop] = swiglu(sent.hidden[start:stop], self.w13[j], self.w2[j])
        y = self.dispatcher.combine(outputs, sent.handle)
        return y if self.shared is None else y + self.shared(x)
