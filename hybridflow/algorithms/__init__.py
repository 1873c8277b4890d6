"""hybridflow.algorithms: pure tensor functions of the RL algorithms, with registries.

Advantage estimators (`advantages`), policy and value losses (`losses`), KL estimators and KL in
reward (`kl`), loss aggregation (`aggregation`), KL controllers (`kl_control`), DAPO helpers (`dapo`),
the training–inference mismatch (`mismatch`) and its correction (`rollout_correction`), mixture-of-experts
routing (`moe_routing`: replayed routing weights, router agreement, the load-balancing loss), offline
preference losses and the reward model's (`preference_losses`), on-policy distillation's advantage
(`distillation`), and masked statistics (`utils`). No I/O and no distributed calls: the trainer and the
workers call these. Add an estimator, a loss or a rollout correction by name with `register_adv_estimator` /
`register_policy_loss` / `register_preference_loss` / `register_rollout_correction`.
"""

from hybridflow.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    gae,
    get_adv_estimator,
    grpo,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from hybridflow.algorithms.aggregation import AGG_MODES, aggregate
from hybridflow.algorithms.dapo import filter_groups, overlong_penalty
from hybridflow.algorithms.distillation import distillation_advantages
from hybridflow.algorithms.kl import KL_KINDS, kl_estimate, kl_loss, kl_penalty_rewards, mean_kl
from hybridflow.algorithms.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller
from hybridflow.algorithms.losses import (
    POLICY_LOSSES,
    cispo_policy_loss,
    compute_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
)
from hybridflow.algorithms.mismatch import (
    merge_mismatch_stats,
    mismatch_metrics,
    mismatch_stats,
    training_rollout_mismatch,
)
from hybridflow.algorithms.moe_routing import load_balancing_loss, replayed_weights, same_experts
from hybridflow.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    PreferenceOut,
    bradley_terry_loss,
    compute_preference_loss,
    preference_needs_reference,
    register_preference_loss,
)
from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    register_rollout_correction,
    rollout_correction,
)
from hybridflow.algorithms.utils import group_index, group_stats, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "PreferenceOut",
    "Registry",
    "aggregate",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "compute_advantages",
    "compute_policy_loss",
    "compute_preference_loss",
    "distillation_advantages",
    "filter_groups",
    "gae",
    "get_adv_estimator",
    "get_policy_loss",
    "group_index",
    "group_stats",
    "grpo",
    "gspo_policy_loss",
    "kl_estimate",
    "kl_loss",
    "kl_penalty_rewards",
    "load_balancing_loss",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_kl",
    "merge_mismatch_stats",
    "mismatch_metrics",
    "mismatch_stats",
    "overlong_penalty",
    "ppo_policy_loss",
    "preference_needs_reference",
    "register_adv_estimator",
    "register_policy_loss",
    "register_preference_loss",
    "register_rollout_correction",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "replayed_weights",
    "rloo",
    "rollout_correction",
    "same_experts",
    "training_rollout_mismatch",
    "value_loss",
]
