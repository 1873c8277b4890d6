"""Offline preference losses (DPO, IPO, SimPO, ORPO), the Bradley–Terry reward-model loss, and their registry.

Inputs are per-pair tensors `[P]`: the policy's summed log-probs of the chosen and of the rejected
completion (`chosen_logps`, `rejected_logps`) and their token counts (`chosen_tokens`, `rejected_tokens`);
the losses that compare with a reference model also take its summed log-probs (`ref_chosen_logps`,
`ref_rejected_logps`). Every entry of `PREFERENCE_LOSSES` returns `PreferenceOut`: the per-pair losses
(the caller averages them over the pairs of a mini-batch) and the implicit rewards of each side, whose
difference is the reported margin (`dpo/margin`) and whose order the pair accuracy (`dpo/accuracy`).

- `sigmoid` (DPO, Rafailov et al. 2023, arXiv:2305.18290): -log σ(β·[(c − c_ref) − (r − r_ref)]).
- `ipo` (Azar et al. 2023, arXiv:2310.12036, eq. 17): ((c − c_ref)/n_c − (r − r_ref)/n_r − 1/(2β))², the
  log-ratios averaged per token as TRL does (the IPO authors' normalisation).
- `simpo` (Meng et al. 2024, arXiv:2405.14734): -log σ(β·(c/n_c − r/n_r) − γ); no reference model.
- `orpo` (Hong et al. 2024, arXiv:2403.07691): the chosen completion's mean NLL per token minus
  β·log σ(log odds(chosen) − log odds(rejected)), odds from the mean log-probs; no reference model.

A loss takes a reference model exactly when its signature names `ref_chosen_logps` (`preference_needs_reference`),
so a loss registered with `register_preference_loss` says so by its parameters.
`bradley_terry_loss` is the reward model's: -log σ(s_c − s_r) on scalar scores, plus an optional
centring term that keeps the scores near 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hybridflow.algorithms.registry import Registry

PREFERENCE_LOSSES = Registry("preference loss", n_args=4)


class PreferenceOut(NamedTuple):
    """Per-pair `losses` `[P]` and the implicit rewards `chosen_rewards`, `rejected_rewards` `[P]` (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def register_preference_loss(name: str, override: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering `fn(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, **options) ->
    PreferenceOut`; options it may name: `beta`, `simpo_gamma`, `ref_chosen_logps`, `ref_rejected_logps`."""
    return PREFERENCE_LOSSES.register(name, override=override)


def preference_needs_reference(name: str) -> bool:
    """Whether preference loss `name` compares with a reference model (its signature takes `ref_chosen_logps`)."""
    return "ref_chosen_logps" in inspect.signature(PREFERENCE_LOSSES.get_fn(name)).parameters


def compute_preference_loss(name: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                            chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                            **options: Any) -> PreferenceOut:
    """Run preference loss `name` on per-pair inputs (see the module docstring); options it does not take
    (e.g. reference log-probs for `simpo`) are left out, unknown ones raise."""
    _check_pairs(chosen_logps=chosen_logps, rejected_logps=rejected_logps, chosen_tokens=chosen_tokens,
                 rejected_tokens=rejected_tokens, **{k: v for k, v in options.items() if isinstance(v, torch.Tensor)})
    return PREFERENCE_LOSSES.call(name, (chosen_logps, rejected_logps, chosen_tokens, rejected_tokens), options)


def _check_pairs(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"preference loss inputs must all be 1-D [pairs] tensors of one length, got {shapes}")


def _per_token(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logps / tokens.clamp(min=1)


@register_preference_loss("sigmoid")
def dpo_sigmoid_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
                     rejected_tokens: torch.Tensor, ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
                     beta: float = 0.1) -> PreferenceOut:
    """DPO: -log σ(β·(chosen log-ratio − rejected log-ratio)); rewards β·log-ratio of each side."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return PreferenceOut(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


@register_preference_loss("ipo")
def ipo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
             rejected_tokens: torch.Tensor, ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float = 0.1) -> PreferenceOut:
    """IPO: (per-token chosen log-ratio − per-token rejected log-ratio − 1/(2β))²; rewards as DPO's."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta = _per_token(chosen_ratio, chosen_tokens) - _per_token(rejected_ratio, rejected_tokens)
    losses = (delta - 1 / (2 * beta)) ** 2
    return PreferenceOut(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


@register_preference_loss("simpo")
def simpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor, beta: float = 2.0, simpo_gamma: float = 0.5) -> PreferenceOut:
    """SimPO: -log σ(β·(mean chosen log-prob − mean rejected log-prob) − γ); rewards β·mean log-prob."""
    chosen, rejected = _per_token(chosen_logps, chosen_tokens), _per_token(rejected_logps, rejected_tokens)
    losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
    return PreferenceOut(losses, beta * chosen.detach(), beta * rejected.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, accurate on both sides of −log 2 (Mächler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_preference_loss("orpo")
def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
              rejected_tokens: torch.Tensor, beta: float = 0.1) -> PreferenceOut:
    """ORPO: the chosen side's mean NLL per token − β·log σ(log odds ratio); rewards β·mean log-prob."""
    chosen, rejected = _per_token(chosen_logps, chosen_tokens), _per_token(rejected_logps, rejected_tokens)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = -chosen - beta * F.logsigmoid(log_odds)
    return PreferenceOut(losses, beta * chosen.detach(), beta * rejected.detach())


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss `[P]`: -log σ(s_chosen − s_rejected) + center_coef·(s_chosen + s_rejected)²
    (the centring term of Eisenstein et al. 2023, arXiv:2312.09244, as TRL's `center_rewards_coefficient`)."""
    _check_pairs(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    losses = -F.logsigmoid(chosen_scores - rejected_scores)
    if center_coef:
        losses = losses + center_coef * (chosen_scores + rejected_scores) ** 2
    return losses
