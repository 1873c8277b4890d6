"""Rewards: reward functions (verl's per-row signature or TRL's batched one), their registry, and the
manager that scores a step's rows.

- `get_reward_fn(spec)`: ``auto``, a built-in (``gsm8k``, ``math``, ``reasoning_gym``, ``exact_match``,
  ``environment``),
  a name added with `register_reward`, ``path/to/file.py:function_name`` or an import path
  (``package.module.function``).
- `Scorer` / `RewardSpec`: one or several functions with weights, bound by keyword (`binding`), plain or
  ``async def`` (awaited together).
- `RewardManager`: scores rows in a process pool, asynchronously, with a per-row timeout and a
  fallback score; `scores_to_token_scores` puts the scores on the last response token.
- `ModelReward` (in `hybridflow.rewards.model_reward`): a sequence-classification reward model.
"""

from hybridflow.rewards import (  # noqa: F401  (registers built-ins)
    environment,
    exact_match,
    gsm8k,
    math_equiv,
    reasoning_tasks,
)
from hybridflow.rewards.failures import EnvironmentFailed, RewardFunctionFailed, RowsFailed
from hybridflow.rewards.manager import RewardManager, RewardResult, rows_from, scores_to_token_scores
from hybridflow.rewards.registry import (
    AUTO_ROUTES,
    REWARD_FUNCTIONS,
    get_reward_fn,
    register_reward,
    register_route,
    route_data_source,
    split_result,
)
from hybridflow.rewards.scorer import RewardSpec, Scorer

__all__ = [
    "AUTO_ROUTES",
    "EnvironmentFailed",
    "REWARD_FUNCTIONS",
    "RewardFunctionFailed",
    "RewardManager",
    "RewardResult",
    "RewardSpec",
    "RowsFailed",
    "Scorer",
    "get_reward_fn",
    "register_reward",
    "register_route",
    "route_data_source",
    "rows_from",
    "scores_to_token_scores",
    "split_result",
]
