"""The `environment` reward: a multi-turn trajectory's environment (and tool) rewards, summed over its
turns, which the rollout puts in ``extra_info["env_reward"]`` (see `hybridflow.agents`). For runs whose
environment does all the scoring; a reward function of your own can combine that value with others."""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.registry import register_reward


@register_reward("environment")
def environment_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """``extra_info["env_reward"]``; KeyError when the row did not come from a multi-turn episode."""
    if not isinstance(extra_info, dict) or "env_reward" not in extra_info:
        raise KeyError("the `environment` reward reads extra_info['env_reward'], which only multi-turn rollouts "
                       "(agent.environment / agent.tools) set")
    return float(extra_info["env_reward"])
