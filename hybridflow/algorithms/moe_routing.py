"""Pure functions of mixture-of-experts routing: the routing weights of given experts (router replay), whether
two routings chose the same experts (router agreement), and the load-balancing auxiliary loss.

Shapes: N tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch


def replayed_weights(logits: torch.Tensor, ids: torch.Tensor, normalise: bool, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights a top-k router gives experts `ids` [N, k] from its `logits` [N, E]: their softmax
    probabilities (fp32), renormalised to sum 1 when the router does (`normalise`), in `dtype`. For the
    router's own top-k these are exactly its weights; for replayed experts they stay differentiable in the
    logits, so the router keeps learning under replay."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] bool: routings a and b [N, k] chose the same set of experts (in any order)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def load_balancing_loss(probs: list[torch.Tensor], ids: list[torch.Tensor], num_experts: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the sparse layers, as transformers computes it: with f_e the
    share of all (token, choice) assignments, over every layer, that went to expert e (times k) and P_e the mean
    router probability of e, `E x sum_e f_e P_e` (k when balanced). probs [N, E] (softmax over all experts,
    differentiable) and ids [N, k] (the experts used) per layer; mask [N]: tokens that count (None: all)."""
    weight = torch.ones(probs[0].shape[0], device=probs[0].device) if mask is None else mask.float()
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=probs[0].device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=probs[0].device)
    for p, chosen in zip(probs, ids):
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(chosen.shape[-1]))
        prob_sum = prob_sum + (p.float() * weight[:, None]).sum(0)
    rows = weight.sum() * len(probs)
    return num_experts * ((assigned / rows) * (prob_sum / rows)).sum()
