"""Training–inference mismatch: how far the rollout engine's sampled log-probs lie from the trainer's.

The rollout engine reports the log-prob of every token it sampled (`rollout_log_probs`); the trainer
computes its own log-prob of the same token (`old_log_probs`, or the update's own log-probs, detached,
when that pass is skipped). Different kernels, dtypes and batch shapes make the two differ, and RL is
sensitive to the gap (verl's and TRL's "training–inference mismatch"). Metrics, with verl's names
(p = exp(log-prob), r = p_train / p_rollout, means over the real response tokens):

| key | value |
|---|---|
| `training/rollout_probs_diff_mean`, `_max`, `_std` | mean, max and std of \\|p_train − p_rollout\\| |
| `training/rollout_actor_probs_pearson_corr` | Pearson correlation of p_train and p_rollout |
| `rollout_corr/kl` | mean of log p_rollout − log p_train (k1 estimate of KL(π_rollout ‖ π_train)) |
| `rollout_corr/k3_kl` | mean of r − log r − 1 (k3 estimate of the same KL; ≥ 0, low variance) |
| `rollout_corr/log_prob_abs_diff_mean` | mean of \\|log p_train − log p_rollout\\| |
| `rollout_corr/max_abs_logp_diff` | max of \\|log p_train − log p_rollout\\| (exactly 0 in exact mode) |

The statistics are kept as sums (plus two maxima), so pieces of a batch (micro-batches, data-parallel
ranks) combine exactly: `mismatch_stats` per piece, `merge_mismatch_stats` (or an all-reduce: SUM on
the first `len(STAT_SUMS)` entries, MAX on the last `STAT_MAXES`), then `mismatch_metrics`.
"""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.kl import kl_estimate
from hybridflow.algorithms.utils import check_shapes, masked_sum

# The sums of `mismatch_stats`, in order; two maxima follow them: of |p_train - p_rollout| and of
# |log p_train - log p_rollout|.
STAT_SUMS = ("tokens", "abs_diff", "sq_diff", "k1", "k3", "log_abs_diff",
             "p_train", "p_rollout", "p_train_sq", "p_rollout_sq", "p_cross")
STAT_MAXES = 2


def mismatch_stats(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                   ) -> torch.Tensor:
    """Sufficient statistics of the mismatch over the masked tokens: float64 `[len(STAT_SUMS) + STAT_MAXES]`,
    the sums named by `STAT_SUMS`, then the max absolute probability difference and the max absolute log-prob
    difference (0 with no tokens). Inputs are `[B, R]`; gradients are not tracked."""
    check_shapes("train_logp", train_logp=train_logp, rollout_logp=rollout_logp, response_mask=response_mask)
    train, rollout = train_logp.detach().double(), rollout_logp.detach().double()
    mask = response_mask.detach().double()
    p_train, p_rollout = train.exp(), rollout.exp()
    diff = (p_train - p_rollout).abs()
    per_token = (torch.ones_like(train), diff, diff.square(), kl_estimate(rollout, train, "k1"),
                 kl_estimate(rollout, train, "k3"), (train - rollout).abs(), p_train, p_rollout,
                 p_train.square(), p_rollout.square(), p_train * p_rollout)
    sums = torch.stack([masked_sum(values, mask) for values in per_token])
    largest = [torch.where(mask.bool(), d, torch.zeros_like(d)).max() if d.numel() else d.new_zeros(())
               for d in (diff, (train - rollout).abs())]
    return torch.cat([sums, torch.stack(largest)])


def merge_mismatch_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The statistics of two pieces together (sums add, the maxima are the larger)."""
    return torch.cat([a[:-STAT_MAXES] + b[:-STAT_MAXES], torch.maximum(a[-STAT_MAXES:], b[-STAT_MAXES:])])


def mismatch_metrics(stats: torch.Tensor) -> dict[str, float]:
    """The metrics of the module docstring from (merged) `mismatch_stats`; {} when there are no tokens.
    The correlation is left out when either side's probabilities do not vary."""
    s = dict(zip(STAT_SUMS, stats[:-STAT_MAXES].tolist()))
    n = s["tokens"]
    if n <= 0:
        return {}
    mean = {k: v / n for k, v in s.items()}
    out = {
        "training/rollout_probs_diff_mean": mean["abs_diff"],
        "training/rollout_probs_diff_max": float(stats[-2]),
        "training/rollout_probs_diff_std": math.sqrt(max(mean["sq_diff"] - mean["abs_diff"] ** 2, 0.0)),
        "rollout_corr/kl": mean["k1"],
        "rollout_corr/k3_kl": mean["k3"],
        "rollout_corr/log_prob_abs_diff_mean": mean["log_abs_diff"],
        "rollout_corr/max_abs_logp_diff": float(stats[-1]),
    }
    var_train = mean["p_train_sq"] - mean["p_train"] ** 2
    var_rollout = mean["p_rollout_sq"] - mean["p_rollout"] ** 2
    if var_train > 0 and var_rollout > 0:
        cov = mean["p_cross"] - mean["p_train"] * mean["p_rollout"]
        out["training/rollout_actor_probs_pearson_corr"] = cov / math.sqrt(var_train * var_rollout)
    return out


def training_rollout_mismatch(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                              ) -> dict[str, float]:
    """The mismatch metrics of one batch: `mismatch_metrics(mismatch_stats(...))`."""
    return mismatch_metrics(mismatch_stats(train_logp, rollout_logp, response_mask))
