"""Policy losses (PPO with clip-higher and dual-clip, GSPO, CISPO), the value loss, and the policy-loss registry.

Inputs are `[batch, response_len]` tensors: `old_logp` (the actor before the update, no gradient),
`logp` (the actor being trained), `advantages`, `response_mask`. Every policy loss returns
`(loss, metrics)`: a scalar loss and a dict of detached scalar tensors (`pg_clipfrac`, `ppo_kl`,
`pg_clipfrac_lower`). Entries of `POLICY_LOSSES` share the calling convention
`fn(old_logp, logp, advantages, response_mask, **options)`; `compute_policy_loss(name, ...)` passes
each the options its signature names, so one actor config serves every loss. Aggregation options
(`agg`, `global_token_count`, `global_seq_count`, `response_len`) are those of `aggregate`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hybridflow.algorithms.aggregation import Count, aggregate
from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import check_shapes, masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0
LossOut = tuple[torch.Tensor, dict[str, torch.Tensor]]

POLICY_LOSSES = Registry("policy loss", n_args=4)


def register_policy_loss(name: str, override: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering `fn(old_logp, logp, advantages, response_mask, **options) -> (loss, metrics)`."""
    return POLICY_LOSSES.register(name, override=override)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """The registered policy loss `name`; `ValueError` with a did-you-mean when unknown."""
    return POLICY_LOSSES.get_fn(name)


def compute_policy_loss(
    name: str, old_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    **options: Any,
) -> LossOut:
    """Run policy loss `name` (`ppo`/`vanilla`, `gspo`, `cispo`, or yours) -> `(loss, metrics)`.

    Options the loss does not take are ignored (e.g. `clip_c` for `gspo`); unknown ones raise.
    """
    return POLICY_LOSSES.call(name, (old_logp, logp, advantages, response_mask), options)


def _metrics(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in values.items()}


@register_policy_loss("ppo")
@register_policy_loss("vanilla")
def ppo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    response_len: int | None = None,
) -> LossOut:
    """Clipped PPO surrogate (Schulman et al. 2017, arXiv:1707.06347) with clip-higher and dual-clip.

    ratio = exp(clamp(logp - old_logp, +-20)); per token
    L = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)) (asymmetric bounds: DAPO's
    clip-higher, arXiv:2503.14476); for A < 0 it is further capped at -A * clip_c (dual-clip,
    Ye et al. 2020, arXiv:1912.09729; `clip_c` > 1). Aggregated with `agg`.
    Metrics: `pg_clipfrac` (tokens where the clipped term won), `ppo_kl` (token-mean of
    old_logp - logp), `pg_clipfrac_lower` (tokens where the dual-clip cap applied).
    """
    if not clip_c > 1.0:
        raise ValueError(f"clip_c (the dual-clip ratio bound) must be > 1, got {clip_c}")
    check_shapes("logp", old_logp=old_logp, logp=logp, advantages=advantages, response_mask=response_mask)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(dual_cap, clip_loss), clip_loss)
    loss = aggregate(pg_losses, response_mask, agg, global_token_count, global_seq_count, response_len)
    return loss, _metrics(
        pg_clipfrac=masked_mean(torch.gt(clipped, unclipped).to(logp.dtype), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=masked_mean((torch.gt(clip_loss, dual_cap) & negative).to(logp.dtype), response_mask),
    )


def gspo_token_losses(
    old_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, ratio_mask: torch.Tensor,
    clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token's per-token losses `[batch, T]`, before aggregation: (losses, clipped term, unclipped term).

    Each row's sequence ratio s_i = exp(mean of logp - old_logp over the tokens `ratio_mask` marks), carried to
    every token of the row as log s_it = sg[log s_i] + logp - sg[logp] (value s_i, gradient of the token's own
    logp), clamped at 10 in log space; loss_it = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high)).
    A row with no marked token has s_i = 1. Tokens outside `ratio_mask` still get a loss (the caller's
    aggregation mask decides which count): Tinker's `gspo` sums them all, `gspo_policy_loss` masks them.
    """
    log_ratio = logp - old_logp
    seq_len = ratio_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, ratio_mask, dim=-1) / seq_len
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped, unclipped


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    *,
    global_seq_count: Count | None = None,
) -> LossOut:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    `gspo_token_losses` with the sequence ratio over the row's response tokens, always aggregated
    `seq-mean-token-mean` (the paper's defaults: clip_low 3e-4, clip_high 4e-4).
    Metrics: `pg_clipfrac`, `ppo_kl` (token-mean of old_logp - logp), `pg_clipfrac_lower` (0).
    """
    check_shapes("logp", old_logp=old_logp, logp=logp, advantages=advantages, response_mask=response_mask)
    pg_losses, clipped, unclipped = gspo_token_losses(old_logp, logp, advantages, response_mask, clip_low, clip_high)
    loss = aggregate(pg_losses, response_mask, "seq-mean-token-mean", global_seq_count=global_seq_count)
    return loss, _metrics(
        pg_clipfrac=masked_mean(torch.gt(clipped, unclipped).to(logp.dtype), response_mask),
        ppo_kl=masked_mean(old_logp - logp, response_mask),
        pg_clipfrac_lower=torch.zeros((), dtype=logp.dtype, device=logp.device),
    )


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    response_len: int | None = None,
) -> LossOut:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585).

    Per token L = -sg[clip(ratio, 1 - clip_low, 1 + clip_high)] * A * logp, ratio = exp(clamp(logp -
    old_logp, +-20)): the importance weight is clipped and detached, so every token keeps a gradient.
    Metrics: `pg_clipfrac` (tokens whose ratio lies outside the bounds), `ppo_kl`, `pg_clipfrac_lower` (0).
    """
    check_shapes("logp", old_logp=old_logp, logp=logp, advantages=advantages, response_mask=response_mask)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    pg_losses = -weight * advantages * logp
    loss = aggregate(pg_losses, response_mask, agg, global_token_count, global_seq_count, response_len)
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return loss, _metrics(
        pg_clipfrac=masked_mean(outside.to(logp.dtype), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask),
        pg_clipfrac_lower=torch.zeros((), dtype=logp.dtype, device=logp.device),
    )


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float = 0.5,
    agg: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    response_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss of PPO: 0.5 * aggregate(max((V - G)^2, (clip(V, V_old +- clip_range) - G)^2)).

    Returns `(loss, clipfrac)`, clipfrac (detached) = masked mean of tokens where the clipped error won.
    """
    check_shapes("vpreds", vpreds=vpreds, returns=returns, old_values=old_values, response_mask=response_mask)
    vclipped = torch.clamp(vpreds, min=old_values - clip_range, max=old_values + clip_range)
    err = (vpreds - returns) ** 2
    err_clipped = (vclipped - returns) ** 2
    loss = 0.5 * aggregate(
        torch.maximum(err, err_clipped), response_mask, agg, global_token_count, global_seq_count, response_len
    )
    return loss, masked_mean(torch.gt(err_clipped, err).to(vpreds.dtype), response_mask).detach()
