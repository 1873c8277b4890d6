"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax) and their registry.

Each estimator is a pure function of `[batch, response_len]` tensors returning `(advantages, returns)`,
computed without gradient. `response_mask` is 1.0 on real response tokens and 0.0 after the end;
`group_ids` holds one hashable per row (the `uid` row field), equal for the samples of one prompt.

Uniform calling convention (what the trainer uses): every entry of `ADV_ESTIMATORS` is called as
`fn(data, **options)`, where `data` is any mapping (a dict, a `Batch`) with the row keys
`token_rewards`, `response_mask` and, when the estimator needs them, `values`, `uid` (group ids) and
`baselines` (`[batch]`). `compute_advantages(name, data, gamma=..., lam=..., scale_by_std=..., ...)`
looks the entry up and passes only the options its signature names, so one algorithm config serves
every estimator; an option no estimator knows is an error with a did-you-mean. Add your own with:

    @register_adv_estimator("my_estimator")
    def my_estimator(data, gamma: float = 1.0):
        ...
        return advantages, returns
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Protocol

import numpy as np
import torch

from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import check_shapes, group_stats, masked_whiten

GroupIds = Sequence[Any] | np.ndarray | torch.Tensor
ADV_ESTIMATORS = Registry("advantage estimator", n_args=1)


def register_adv_estimator(name: str, override: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering `fn(data, **options) -> (advantages, returns)` under `name`."""
    return ADV_ESTIMATORS.register(name, override=override)


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """The registered estimator `name`; `ValueError` with a did-you-mean when unknown."""
    return ADV_ESTIMATORS.get_fn(name)


class Rows(Protocol):
    """What an estimator reads its inputs from: a `Batch`, or a dict of tensors (and per-row fields)."""

    def __getitem__(self, key: str) -> Any: ...

    def __contains__(self, key: object) -> bool: ...


def compute_advantages(name: str, data: Rows, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator `name` on `data` (see the module docstring) -> `(advantages, returns)`, both `[batch, R]`.

    Options (`gamma`, `lam`, `scale_by_std`, `eps`, ...) that the estimator does not take are ignored.
    """
    return ADV_ESTIMATORS.call(name, (data,), options)


def require(data: Rows, estimator: str, *keys: str) -> tuple[Any, ...]:
    """`(data[key] for key in keys)`; a `KeyError` naming the estimator and the batch's keys if one is missing."""
    values = []
    for key in keys:
        try:
            value = data[key]
        except (KeyError, IndexError):
            value = None
        if value is None:
            held = list(data.keys()) if hasattr(data, "keys") else "?"
            raise KeyError(f"advantage estimator {estimator!r} needs the row key {key!r}; the batch has {held}")
        values.append(value)
    return tuple(values)


def _outcome_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Check shapes and return the per-row score `token_rewards.sum(-1)` `[batch]`."""
    check_shapes("token_rewards", token_rewards=token_rewards, response_mask=response_mask)
    return token_rewards.sum(dim=-1)


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Runs backwards over `[batch, R]`: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next,
    where masked positions are skipped (V_next and A_next carry over them unchanged).
    Returns `(advantages, returns)`: returns = un-whitened advantages + values; the advantages are then
    whitened over the mask (mean 0, unbiased variance, `rsqrt(var + 1e-8)`).
    """
    check_shapes("token_rewards", token_rewards=token_rewards, values=values, response_mask=response_mask)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    advantages = torch.empty_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_adv = adv_t * mask[:, t] + (1 - mask[:, t]) * last_adv
        advantages[:, t] = last_adv
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


@torch.no_grad()
def grpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    score = sum of the row's token rewards; A = (score - group mean) / (group std (unbiased) + eps), or
    `score - group mean` without the division when `scale_by_std=False` (Dr.GRPO, arXiv:2503.20783).
    A group of one has mean 0 and std 1. A `[batch]` is broadcast over the mask; returns `(A, A)`.
    """
    scores = _outcome_scores(token_rewards, response_mask)
    _, mean, std = group_stats(scores, group_ids)
    adv = scores.double() - mean
    if scale_by_std:
        adv = adv / (std + eps)
    adv = adv.to(token_rewards.dtype).unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def rloo(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

    For a group of n > 1: A = score * n/(n-1) - mean * n/(n-1) (the score minus the mean of the other
    n - 1 scores); a group of one keeps its score. Broadcast over the mask; returns `(A, A)`.
    """
    scores = _outcome_scores(token_rewards, response_mask)
    size, mean, _ = group_stats(scores, group_ids)
    s = scores.double()
    factor = size / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, s * factor - mean * factor, s)
    adv = adv.to(token_rewards.dtype).unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    G_t = r_t + gamma * G_{t+1}, where G_{t+1} is the return of the next masked token: an unmasked
    position (the padding after the response, a multi-turn row's environment tokens) passes the running
    return through unchanged. Returns `(whiten(G) * mask, G)`: the returns are not whitened.
    """
    check_shapes("token_rewards", token_rewards=token_rewards, response_mask=response_mask)
    returns = torch.empty_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        value = token_rewards[:, t] + gamma * running
        returns[:, t] = value
        running = torch.where(response_mask[:, t] > 0, value, running)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    A = score - group mean (a group of one has mean 0), broadcast over the mask, whitened over the mask
    (token-weighted), masked again. Returns `(A, A)`.
    """
    scores = _outcome_scores(token_rewards, response_mask)
    _, mean, _ = group_stats(scores, group_ids)
    centred = (scores.double() - mean).to(token_rewards.dtype)
    tiled = centred.unsqueeze(-1).expand_as(token_rewards) * response_mask
    adv = masked_whiten(tiled, response_mask) * response_mask
    return adv, adv


@torch.no_grad()
def remax(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, arXiv:2310.10505): return minus the greedy response's reward.

    returns = reverse cumulative sum of `token_rewards * mask` along the response; advantages =
    returns - baselines (`[batch]`, the reward of the greedy sample) on masked tokens.
    """
    check_shapes("token_rewards", token_rewards=token_rewards, response_mask=response_mask)
    baselines = torch.as_tensor(baselines, dtype=token_rewards.dtype, device=token_rewards.device)
    if baselines.shape != token_rewards.shape[:1]:
        raise ValueError(
            f"baselines must have shape [batch] = ({token_rewards.shape[0]},), got {tuple(baselines.shape)}"
        )
    returns = (token_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - baselines.unsqueeze(-1) * response_mask
    return advantages, returns


@register_adv_estimator("gae")
def _gae_entry(data: Rows, gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, values, mask = require(data, "gae", "token_rewards", "values", "response_mask")
    return gae(rewards, values, mask, gamma, lam)


@register_adv_estimator("grpo")
def _grpo_entry(
    data: Rows, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, mask, uid = require(data, "grpo", "token_rewards", "response_mask", "uid")
    return grpo(rewards, mask, uid, scale_by_std=scale_by_std, eps=eps)


@register_adv_estimator("rloo")
def _rloo_entry(data: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return rloo(*require(data, "rloo", "token_rewards", "response_mask", "uid"))


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_pp_entry(data: Rows, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, mask = require(data, "reinforce_plus_plus", "token_rewards", "response_mask")
    return reinforce_plus_plus(rewards, mask, gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline_entry(data: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return reinforce_plus_plus_baseline(
        *require(data, "reinforce_plus_plus_baseline", "token_rewards", "response_mask", "uid")
    )


@register_adv_estimator("remax")
def _remax_entry(data: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return remax(*require(data, "remax", "token_rewards", "response_mask", "baselines"))
