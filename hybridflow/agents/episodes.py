"""Which rollout a multi-turn run uses: the in-process `AgentLoop` (`agent.environment` / `agent.tools`) or
`EndpointRollout` with the runner of the way in the `agent` section names:

| key | runner (in the runner process) | its keyword arguments |
|---|---|---|
| `agent.runner` | the user's `file.py:fn` | `agent.env_kwargs` |
| `agent.verifiers` | `verifiers_runner.run` | env, env_args=`agent.env_kwargs` |
| `agent.gym` | `gym_runner.run` | env, env_kwargs, max_turns=`agent.max_turns` |
| `agent.openenv` | `openenv_runner.run` | client_class, env_kwargs, max_turns |
"""

from __future__ import annotations

from typing import Any, cast

from hybridflow.agents.endpoint.endpoint_rollout import EndpointRollout
from hybridflow.agents.loop.agent_loop import AgentLoop
from hybridflow.data.image_prompts import VisionPrompts


def _kwargs(value: Any) -> dict[str, Any]:
    """A config mapping as a plain dict (it travels to the runner process)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            container = OmegaConf.to_container(value, resolve=True)
            if not isinstance(container, dict):
                raise TypeError(f"agent.env_kwargs must be a mapping of keyword arguments, got a "
                                f"{type(container).__name__}")
            return cast(dict[str, Any], container)  # keyword arguments: the config's keys are strings
    except ImportError:
        pass
    return dict(value or {})


def runner_of(agent_cfg: Any) -> tuple[str, dict[str, Any]] | None:
    """(runner spec, its keyword arguments) of the way in `agent_cfg` names, None for the in-process loop."""
    env_kwargs = _kwargs(agent_cfg.env_kwargs)
    if agent_cfg.runner:
        return agent_cfg.runner, env_kwargs
    if agent_cfg.verifiers:
        return "hybridflow.agents.adapters.verifiers_runner:run", {"env": agent_cfg.verifiers, "env_args": env_kwargs}
    if agent_cfg.gym:
        return "hybridflow.agents.adapters.gym_runner:run", {"env": agent_cfg.gym, "env_kwargs": env_kwargs,
                                                             "max_turns": agent_cfg.max_turns}
    if agent_cfg.openenv:
        return "hybridflow.agents.adapters.openenv_runner:run", {"client_class": agent_cfg.openenv,
                                                                 "env_kwargs": env_kwargs,
                                                                 "max_turns": agent_cfg.max_turns}
    return None


def build_episodes(agent_cfg: Any, tokenizer: Any, max_prompt_length: int, budget: int,
                   images: VisionPrompts | None = None) -> AgentLoop | EndpointRollout:
    """The multi-turn rollout of `agent_cfg`; budget: response tokens per trajectory (data.max_response_length);
    images: a vision-language model's tokenizer and image processor, whose images only the endpoint reads (the
    in-process loop continues live sequences, which the vision engine does not keep)."""
    runner = runner_of(agent_cfg)
    if runner is None:
        if images is not None:
            raise ValueError("agent.environment / agent.tools episodes continue live sequences in the fast engine, "
                             "which a vision-language model does not run on; use an endpoint way in (agent.runner, "
                             "agent.gym, ...)")
        return AgentLoop(agent_cfg, tokenizer, budget)
    return EndpointRollout(agent_cfg, tokenizer, budget, max_prompt_length, *runner, images=images)
