"""Tinker's built-in losses (`loss_fn` of a forward_backward) mapped onto hybridflow's algorithms library.

Tinker's losses are sums over every token of every datum (no mean), each datum's `loss_fn_inputs` aligned
with its input tokens. `tinker_loss(name, logp, inputs, config)` takes the trained model's log-probs of
`target_tokens` (`[batch, T]`, padded, with `mask`) and returns the scalar loss:
- `cross_entropy`: sum(-logp * weights);
- `importance_sampling`: sum(-exp(logp - logprobs) * advantages), `logprobs` the sampler's: our `ppo` loss
  with every clip bound at infinity;
- `ppo`: sum(max(-ratio * A, -clip(ratio, clip_low_threshold, clip_high_threshold) * A)), the thresholds
  from `loss_fn_config` (defaults 0.8 and 1.2, the ratio bounds): our `ppo` loss with
  clip_low = 1 - clip_low_threshold, clip_high = clip_high_threshold - 1 and no dual clip.
The policy losses run through `compute_policy_loss` with `agg="token-mean"` over a token count of 1, which is
the plain sum Tinker computes.
"""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.losses import compute_policy_loss
from hybridflow.algorithms.utils import masked_sum

SERVED_LOSSES = ("cross_entropy", "importance_sampling", "ppo")
_INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
           "ppo": ("logprobs", "advantages")}
_CONFIG = {"cross_entropy": {}, "importance_sampling": {},
           "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


class LossRequestError(ValueError):
    """A loss the server does not serve, or its inputs/config wrong; the message says what is valid."""


def check_loss(name: str, input_names: set[str], config: dict[str, float | str]) -> None:
    """Refuse an unserved loss, missing loss inputs, or an unknown config key, naming the valid ones."""
    if name not in SERVED_LOSSES:
        raise LossRequestError(f"loss_fn={name!r} is not served by hybridflow serve; served: "
                               f"{', '.join(SERVED_LOSSES)} (custom losses run client-side through cross_entropy)")
    missing = [k for k in _INPUTS[name] if k not in input_names]
    if missing:
        raise LossRequestError(f"loss_fn={name!r} needs loss_fn_inputs {list(_INPUTS[name])}; missing {missing}")
    unknown = sorted(set(config) - set(_CONFIG[name]))
    if unknown:
        raise LossRequestError(f"loss_fn_config keys {unknown} are not taken by loss_fn={name!r}; valid: "
                               f"{sorted(_CONFIG[name]) or 'none'}")
    for key, value in config.items():
        if not isinstance(value, float):
            raise LossRequestError(f"loss_fn_config[{key!r}]={value!r} must be a number")


def tinker_loss(name: str, logp: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor],
                config: dict[str, float | str]) -> torch.Tensor:
    """The scalar loss `name` (see the module docstring); `logp`, `mask` and each of `inputs` `[batch, T]`."""
    if name == "cross_entropy":
        return masked_sum(-logp * inputs["weights"], mask)
    options = {**_CONFIG[name], **config}
    if name == "ppo":
        clip_low, clip_high = 1.0 - float(options["clip_low_threshold"]), float(options["clip_high_threshold"]) - 1.0
    else:  # importance_sampling: the unclipped ratio
        clip_low = clip_high = math.inf
    loss, _ = compute_policy_loss("ppo", inputs["logprobs"], logp, inputs["advantages"], mask,
                                  clip_low=clip_low, clip_high=clip_high, clip_c=math.inf,
                                  agg="token-mean", global_token_count=1)
    return loss
