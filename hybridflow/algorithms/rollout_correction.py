"""Rollout correction: importance weights for the gap between the rollout engine's and the trainer's policy.

Responses are sampled from π_rollout (the rollout engine) but the policy gradient assumes π_train (the
trainer's forward of the same weights); their per-token ratio ρ_t = π_train / π_rollout =
exp(train_logp − rollout_logp) is the importance weight that turns one into the other. Using it as it
is has unbounded variance, so each mode bounds it (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"; Liu, Li et al. 2025, "When speed kills stability"):

| mode | weight w per token (detached) |
|---|---|
| `none` | 1 |
| `token_tis` | min(ρ_t, C) — truncated importance sampling |
| `seq_tis` | min(ρ_seq, C), ρ_seq = Π_t ρ_t over the row's real tokens |
| `token_mis` | ρ_t if lo ≤ ρ_t ≤ C, else 0 — masked importance sampling: the token is dropped |
| `seq_mis` | ρ_seq if lo ≤ ρ_seq ≤ C, else 0 — the whole sequence is dropped |
| `decoupled` | ρ_t if ρ_t ≤ C, else 0 — AReaL's decoupled PPO: no lower bound |

With `old_log_probs` recomputed (the actor's forward before the update), `train_logp` is the proximal policy
π_prox and the policy loss clips its ratio against it, while π_rollout, the behaviour policy that sampled the
tokens (older weights, for samples carried across updates by partial rollouts), only weights each token's term
(Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning system", the decoupled objective;
its `behav_imp_weight_cap` is C). Every mode above is such a weighting; `decoupled` is AReaL's own.

C is `threshold`, lo is `threshold_lower` (default 1/C). Log-ratios are clamped to ±20 before `exp`
(ρ_seq of a long row overflows otherwise); bounds are compared in log space. Every entry of
`ROLLOUT_CORRECTIONS` is `fn(train_logp, rollout_logp, response_mask, **options) -> (weights [B, R],
metrics)`; `rollout_correction(name, ...)` passes each the options its signature names. Metrics (verl's
names, means over real response tokens; for the `seq_*` modes a token counts with its sequence):
`rollout_is_mean` (mean weight), `rollout_is_ratio_fraction_high` (ratio above C: truncated or
dropped), and for the masked modes `rollout_is_ratio_fraction_low` (below lo) and
`rollout_rs_masked_fraction` (dropped).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import check_shapes, masked_mean, masked_sum

LOG_RATIO_BOUND = 20.0
CorrectionOut = tuple[torch.Tensor, dict[str, torch.Tensor]]

ROLLOUT_CORRECTIONS = Registry("rollout correction", n_args=3)


def register_rollout_correction(name: str, override: bool = False
                                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering `fn(train_logp, rollout_logp, response_mask, **options) -> (weights, metrics)`."""
    return ROLLOUT_CORRECTIONS.register(name, override=override)


def rollout_correction(name: str, train_logp: torch.Tensor, rollout_logp: torch.Tensor,
                       response_mask: torch.Tensor, **options: Any) -> CorrectionOut:
    """Run correction `name` -> (detached weights `[B, R]` multiplying each token's policy loss, metrics).

    Options the mode does not take are ignored (`threshold_lower` for `token_tis`); unknown ones raise.
    """
    check_shapes("train_logp", train_logp=train_logp, rollout_logp=rollout_logp, response_mask=response_mask)
    return ROLLOUT_CORRECTIONS.call(name, (train_logp.detach(), rollout_logp, response_mask), options)


def _log_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str
               ) -> torch.Tensor:
    """log ρ per token (`[B, R]`), or per sequence broadcast over its tokens (the sum over real tokens)."""
    log_ratio = train_logp - rollout_logp
    if level == "seq":
        log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    return log_ratio


def _check_threshold(threshold: float) -> None:
    if not threshold > 0:
        raise ValueError(f"rollout correction threshold must be > 0, got {threshold}")


def _lower_bound(threshold: float, threshold_lower: float | None) -> float:
    """The lower edge of the kept range (1/threshold by default), after checking 0 < lower < threshold."""
    _check_threshold(threshold)
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    if not 0 < lower < threshold:
        raise ValueError(f"rollout correction needs 0 < threshold_lower < threshold; got threshold_lower={lower}"
                         f"{' (1/threshold)' if threshold_lower is None else ''}, threshold={threshold}")
    return lower


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(mask.dtype), mask)


def _truncated(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> CorrectionOut:
    _check_threshold(threshold)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = ratio.clamp(max=threshold)
    return weights, {"rollout_is_mean": masked_mean(weights, mask),
                     "rollout_is_ratio_fraction_high": _fraction(log_ratio > math.log(threshold), mask)}


def _masked(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float, lower: float) -> CorrectionOut:
    """Weights ρ inside [lower, threshold], 0 outside (`lower` 0: no lower edge)."""
    high = log_ratio > math.log(threshold)
    low = log_ratio < math.log(lower) if lower > 0 else torch.zeros_like(high)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = torch.where(high | low, torch.zeros_like(ratio), ratio)
    return weights, {"rollout_is_mean": masked_mean(weights, mask),
                     "rollout_is_ratio_fraction_high": _fraction(high, mask),
                     "rollout_is_ratio_fraction_low": _fraction(low, mask),
                     "rollout_rs_masked_fraction": _fraction(high | low, mask)}


@register_rollout_correction("none")
def no_correction(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                  ) -> CorrectionOut:
    """Weight 1 everywhere: the policy gradient treats the samples as π_train's."""
    return torch.ones_like(train_logp), {}


@register_rollout_correction("token_tis")
def token_tis(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
              threshold: float = 2.0) -> CorrectionOut:
    """Token-level truncated IS: w_t = min(ρ_t, threshold)."""
    return _truncated(_log_ratio(train_logp, rollout_logp, response_mask, "token"), response_mask, threshold)


@register_rollout_correction("seq_tis")
def seq_tis(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
            threshold: float = 2.0) -> CorrectionOut:
    """Sequence-level truncated IS: every token of a row gets min(Π_t ρ_t, threshold)."""
    return _truncated(_log_ratio(train_logp, rollout_logp, response_mask, "seq"), response_mask, threshold)


@register_rollout_correction("token_mis")
def token_mis(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
              threshold: float = 2.0, threshold_lower: float | None = None) -> CorrectionOut:
    """Token-level masked IS: w_t = ρ_t inside [threshold_lower, threshold], 0 (token dropped) outside."""
    return _masked(_log_ratio(train_logp, rollout_logp, response_mask, "token"), response_mask, threshold,
                   _lower_bound(threshold, threshold_lower))


@register_rollout_correction("seq_mis")
def seq_mis(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
            threshold: float = 2.0, threshold_lower: float | None = None) -> CorrectionOut:
    """Sequence-level masked IS: the row's tokens get Π_t ρ_t inside the bounds, 0 (row dropped) outside."""
    return _masked(_log_ratio(train_logp, rollout_logp, response_mask, "seq"), response_mask, threshold,
                   _lower_bound(threshold, threshold_lower))


@register_rollout_correction("decoupled")
def decoupled(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
              threshold: float = 2.0) -> CorrectionOut:
    """AReaL's decoupled objective: w_t = π_prox / π_behav per token (`train_logp` the recomputed old log-probs),
    tokens whose weight exceeds `threshold` dropped (weight 0), no lower bound."""
    _check_threshold(threshold)
    return _masked(_log_ratio(train_logp, rollout_logp, response_mask, "token"), response_mask, threshold, 0.0)
