"""Per-token KL estimators between the policy and the reference model, and KL-in-reward shaping.

Estimators of KL(pi || pi_ref) from the sampled token's log-probs (Schulman 2020,
http://joschu.net/blog/kl-approx.html), all differentiable in `logp`:
- `k1` / `kl`: logp - ref_logp (unbiased, high variance, can be negative);
- `abs`: |logp - ref_logp|;
- `k2` / `mse`: 0.5 * (logp - ref_logp)^2;
- `k3` / `low_var_kl`: exp(ref - logp) - (ref - logp) - 1 with the difference clamped to +-20 and the
  result to +-10 (unbiased, non-negative, low variance; the GRPO paper's KL loss).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import Count, aggregate
from hybridflow.algorithms.registry import did_you_mean
from hybridflow.algorithms.utils import check_shapes, masked_mean

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of `kind` (see the module docstring), same shape as `logp`."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp has shape {tuple(logp.shape)} but ref_logp has shape {tuple(ref_logp.shape)}")
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}.{did_you_mean(str(kind), list(KL_KINDS))} Valid: {KL_KINDS}")


def kl_penalty_rewards(
    token_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """KL in reward (Ziegler et al. 2019, arXiv:1909.08593): `token_scores - coef * kl * mask`, `[batch, R]`.

    `logp` is usually the actor's `old_log_probs`; the KL is zeroed after the response ends.
    """
    check_shapes("token_scores", token_scores=token_scores, logp=logp, ref_logp=ref_logp, mask=mask)
    return token_scores - coef * kl_estimate(logp, ref_logp, kind) * mask


def mean_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """The batch KL a KL controller is updated with: the mean over rows of each row's masked-mean KL.

    Rows with an empty mask count as 0. Returns a detached scalar tensor.
    """
    check_shapes("logp", logp=logp, ref_logp=ref_logp, mask=mask)
    kl = kl_estimate(logp.detach(), ref_logp, kind)
    return masked_mean(kl, mask, dim=-1).mean()


def kl_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "low_var_kl", agg: str = "token-mean",
    global_token_count: Count | None = None, global_seq_count: Count | None = None, response_len: int | None = None,
) -> torch.Tensor:
    """KL as a loss term (GRPO's `kl_loss`, arXiv:2402.03300): `aggregate(kl_estimate(...), mask, agg)` with
    `aggregate`'s counts."""
    return aggregate(kl_estimate(logp, ref_logp, kind), mask, agg, global_token_count, global_seq_count,
                     response_len)
