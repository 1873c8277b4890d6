"""Tinker's built-in losses (`loss_fn` of a forward_backward) mapped onto hybridflow's algorithms library.

Tinker's losses are sums over every token of every datum (no mean), each datum's `loss_fn_inputs` aligned
with its input tokens. `tinker_loss(name, logp, mask, inputs, config)` takes the trained model's log-probs of
`target_tokens` (`[batch, T]`, padded, with `mask`) and returns the scalar loss; `logprobs` are the sampler's,
A the `advantages`, ratio = exp(logp - logprobs):
- `cross_entropy`: sum(-logp * weights);
- `importance_sampling`: sum(-ratio * A): our `ppo` loss with every clip bound at infinity;
- `ppo`: sum(max(-ratio * A, -clip(ratio, clip_low_threshold, clip_high_threshold) * A)): our `ppo` loss with
  clip_low = 1 - clip_low_threshold, clip_high = clip_high_threshold - 1 and no dual clip;
- `cispo`: sum(-sg[clip(ratio, clip_low_threshold, clip_high_threshold)] * logp * A): our `cispo` loss;
- `gspo`: sum over every token of GSPO-token's loss, the sequence ratio taken over the tokens
  `sequence_ratio_mask` marks: our `gspo_token_losses`;
- `dro`: sum(-(logp * A - beta / 2 * (logp - logprobs)^2)), `beta` from `loss_fn_config` (Tinker publishes no
  default, so it is required); our algorithms library has no DRO, so it is computed here.
The clip thresholds default to 0.8 and 1.2 (Tinker's for `ppo`; it publishes none for `cispo` and `gspo`).
The policy losses run with `agg="token-mean"` over a token count of 1, which is the plain sum Tinker computes.
`stable_reinforce` is refused: its objective uses information Tinker records at sampling time and does not
publish.
"""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.losses import compute_policy_loss, gspo_token_losses
from hybridflow.algorithms.utils import masked_sum

_CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("logprobs", "advantages")
# loss -> (the loss_fn_inputs it needs besides target_tokens, its loss_fn_config keys with their defaults;
# None: no default, the key is required)
_LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float | None]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (_RL_INPUTS, {}),
    "ppo": (_RL_INPUTS, dict(_CLIPS)),
    "cispo": (_RL_INPUTS, dict(_CLIPS)),
    "gspo": (_RL_INPUTS + ("sequence_ratio_mask",), dict(_CLIPS)),
    "dro": (_RL_INPUTS, {"beta": None}),
}
SERVED_LOSSES = tuple(_LOSSES)


class LossRequestError(ValueError):
    """A loss the server does not serve, or its inputs/config wrong; the message says what is valid."""


def check_loss(name: str, input_names: set[str], config: dict[str, float | str]) -> None:
    """Refuse an unserved loss, missing or unknown loss inputs, or a missing or unknown config key, naming the
    valid ones."""
    if name == "stable_reinforce":
        raise LossRequestError("loss_fn='stable_reinforce' is not served: its objective uses stability information "
                               "Tinker records at sampling time and does not publish; use ppo, cispo or gspo for "
                               "off-policy rows")
    if name not in _LOSSES:
        raise LossRequestError(f"loss_fn={name!r} is not served by hybridflow serve; served: "
                               f"{', '.join(SERVED_LOSSES)} (custom losses run client-side through cross_entropy)")
    needed, options = _LOSSES[name]
    missing = [k for k in needed if k not in input_names]
    if missing:
        raise LossRequestError(f"loss_fn={name!r} needs loss_fn_inputs {list(needed)}; missing {missing}")
    extra = sorted(input_names - set(needed) - {"target_tokens"})
    if extra:
        raise LossRequestError(f"loss_fn={name!r} does not take loss_fn_inputs {extra}; it takes target_tokens and "
                               f"{list(needed)}")
    unknown = sorted(set(config) - set(options))
    if unknown:
        raise LossRequestError(f"loss_fn_config keys {unknown} are not taken by loss_fn={name!r}; valid: "
                               f"{sorted(options) or 'none'}")
    absent = [k for k, default in options.items() if default is None and k not in config]
    if absent:
        raise LossRequestError(f"loss_fn={name!r} needs loss_fn_config {absent} (e.g. {{'beta': 0.05}})")
    for key, value in config.items():
        if not isinstance(value, float):
            raise LossRequestError(f"loss_fn_config[{key!r}]={value!r} must be a number")


def tinker_loss(name: str, logp: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor],
                config: dict[str, float | str]) -> torch.Tensor:
    """The scalar loss `name` (see the module docstring); `logp`, `mask` and each of `inputs` `[batch, T]`."""
    if name == "cross_entropy":
        return masked_sum(-logp * inputs["weights"], mask)
    options = {**_LOSSES[name][1], **config}
    old, advantages = inputs["logprobs"], inputs["advantages"]
    if name == "dro":
        beta = float(options["beta"])  # type: ignore[arg-type]  # check_loss required it
        return masked_sum(-(logp * advantages - 0.5 * beta * (logp - old) ** 2), mask)
    if name == "importance_sampling":  # the unclipped ratio
        loss, _ = compute_policy_loss("ppo", old, logp, advantages, mask, clip_low=math.inf, clip_high=math.inf,
                                      clip_c=math.inf, agg="token-mean", global_token_count=1)
        return loss
    low, high = float(options["clip_low_threshold"]), float(options["clip_high_threshold"])  # type: ignore[arg-type]
    if name == "gspo":
        ratio_mask = (inputs["sequence_ratio_mask"].ne(0) & mask).to(logp.dtype)
        losses, _, _ = gspo_token_losses(old, logp, advantages, ratio_mask, 1.0 - low, high - 1.0)
        return masked_sum(losses, mask)
    # ppo without its dual clip, or cispo (which takes no clip_c)
    loss, _ = compute_policy_loss(name, old, logp, advantages, mask, clip_low=1.0 - low, clip_high=high - 1.0,
                                  clip_c=math.inf, agg="token-mean", global_token_count=1)
    return loss
