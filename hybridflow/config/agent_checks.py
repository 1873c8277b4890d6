"""Checks of the `agent` section, run before any model loads (`hybridflow.config.validate`): its ranges, the engine
multi-turn episodes need, and the endpoint ways in (`agent.runner`, `agent.verifiers`, `agent.gym`, `agent.openenv`),
which exclude each other and the in-process environment and tools."""

from __future__ import annotations

from typing import Any

from hybridflow.config.role_needs import agent_enabled, agent_setting, endpoint_ways


def agent_problems(cfg: Any) -> list[str]:
    """Ranges of the `agent` section, and the engine multi-turn episodes need."""
    agent, problems = cfg.agent, []
    if agent.max_turns < 1:
        problems.append(f"agent.max_turns={agent.max_turns} must be >= 1")
    if agent.max_tool_calls < 0:
        problems.append(f"agent.max_tool_calls={agent.max_tool_calls} must be >= 0")
    if agent.max_tokens_per_turn is not None and agent.max_tokens_per_turn < 1:
        problems.append(f"agent.max_tokens_per_turn={agent.max_tokens_per_turn} must be >= 1 or null")
    if not agent.timeout_s > 0:
        problems.append(f"agent.timeout_s={agent.timeout_s} must be > 0")
    if agent_enabled(agent) and cfg.rollout.engine == "hf":
        problems.append(f"{agent_setting(agent)}: multi-turn episodes "
                        f"continue live sequences turn by turn, which the fast engine does and rollout.engine=hf "
                        f"(transformers.generate) does not; use rollout.engine=auto or fast")
    ways = endpoint_ways(agent)
    if len(ways) > 1 or ways and (agent.environment or agent.tools):
        problems.append(f"{', '.join(ways)} drive the model through the endpoint and exclude each other and agent."
                        f"environment / agent.tools: set one of them")
    if ways and cfg.reward.function == "auto" and not cfg.reward.functions:
        problems.append(f"{ways[0]} returns each trajectory's reward: set reward.function=environment to train on "
                        f"it (or a function of yours that reads extra_info['env_reward']; unset, it follows)")
    for way in ways:
        spec = getattr(agent, way.removeprefix("agent."))
        if way != "agent.verifiers" and ":" not in spec:
            problems.append(f"{way}={spec!r} must name what to load: path/to/file.py:Name or package.module:Name"
                            + (" (or textarena:<env id>)" if way == "agent.gym" else ""))
    if agent.images is not None and not ways:
        problems.append(f"agent.images={str(agent.images).lower()}: it says whether an endpoint's requests may carry "
                        f"images, and no endpoint way in is set (agent.runner, agent.verifiers, agent.gym, "
                        f"agent.openenv); leave it unset (a dataset's images: data.image_key)")
    if agent.max_concurrent_requests < 1:
        problems.append(f"agent.max_concurrent_requests={agent.max_concurrent_requests} must be >= 1")
    if agent.runner_processes is not None and agent.runner_processes < 1:
        problems.append(f"agent.runner_processes={agent.runner_processes} must be >= 1 (or null: min(16, CPU cores))")
    return problems
