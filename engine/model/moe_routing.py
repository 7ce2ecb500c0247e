"""Expert routing: a router's logits -> each token's top-k experts and their weights.

Two rules, each computed with the same torch calls, in the same order and dtypes, as transformers' reference
(``DeepseekV3TopkRouter``, ``Qwen3MoeTopKRouter`` in transformers 5.x), so the experts chosen are the
reference's bit for bit on the same device:

- ``softmax_topk`` (Qwen3-MoE): softmax over all experts in fp32, the ``top_k`` largest
  (``torch.topk(..., sorted=True)``), optionally divided by their sum.
- ``grouped_sigmoid_topk`` (DeepSeek-V3 report, arXiv:2412.19437, section 2.1.2, "noaux_tc"): ``s = sigmoid(
  logits)``; experts are chosen on ``s + e_score_correction_bias``: each of ``n_group`` groups scores the sum
  of its 2 best biased scores, the ``topk_group`` best groups stay eligible, the ``top_k`` best eligible
  experts win (``torch.topk(..., sorted=False)`` at every stage); weights are ``s`` (no bias) of the winners,
  divided by their sum plus 1e-20 when ``norm_topk_prob``, times ``routed_scaling_factor``.

**Ties.** Where scores are exactly equal, the experts (and groups) chosen are the ones ``torch.topk`` returns,
which is implementation-defined and *not* "lowest index first" (on this project's CPU torch, 4 equal scores
among 8 gave indices 4 and 7 for ``k=2``). Calling ``torch.topk`` on the same tensor with the same ``k`` and
``sorted`` flag is what makes ties break as the reference's; a peer on another device (CUDA's ``topk``) may
break the same tie another way, so a prefill on one device and a decode on another can route a tied token
differently (tests/engine/test_moe_models.py holds a model with an exact tie to this rule).

Shapes: ``logits`` ``[T, E]`` (any float dtype); results ``topk_ids`` ``[T, top_k]`` int64 (global expert ids)
and ``topk_weights`` ``[T, top_k]`` float32. Pure functions; any thread.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.model.moe_config import MoEConfig


class Routing(NamedTuple):
    """Each token's experts: ``topk_ids`` ``[T, top_k]`` int64 and ``topk_weights`` ``[T, top_k]`` float32."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """Qwen3-MoE's routing (module docstring)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def grouped_sigmoid_topk(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> Routing:
    """DeepSeek-V3's routing (module docstring). ``bias``: ``[E]`` float32 ``e_score_correction_bias``, or
    None (no bias)."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
        tokens = choice.shape[0]
        grouped = choice.view(tokens, cfg.n_group, cfg.experts_per_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        # the width spelled out: a rank of an expert-parallel step may route no token (T = 0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, cfg.experts_per_group).reshape(tokens,
                                                                                              cfg.num_experts)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * cfg.routed_scaling_factor)


def route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None) -> Routing:
    """The routing ``cfg.scoring_func`` names, for router ``logits`` ``[T, E]``; raises nothing (``cfg`` was
    validated)."""
    if cfg.scoring_func == "sigmoid":
        return grouped_sigmoid_topk(logits, cfg, bias)
    routing = softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)
    if cfg.routed_scaling_factor != 1.0:
        return Routing(routing.topk_ids, routing.topk_weights * cfg.routed_scaling_factor)
    return routing
