"""The `agent` section of `hybridflow train` (docs/agents.md): multi-turn episodes with an environment and tools
in-process, or agent code against the OpenAI-compatible endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridflow.config.options import opt


@dataclass
class AgentConfig:
    """Multi-turn episodes: an environment and/or tools answer each model turn in-process, or agent code
    (a runner, or a verifiers / Gymnasium / OpenEnv environment) drives the model through the
    OpenAI-compatible endpoint (on when any of these is set; the endpoint ways exclude each other and the
    in-process ones)."""

    environment: Optional[str] = opt(None, "environment class answering each model turn: path/to/file.py:Class; "
                                           "null = none")
    env_kwargs: dict[str, Any] = opt({}, "keyword arguments for the environment (a row's "
                                         "extra_info.interaction_kwargs overrides them)")
    tools: list[Any] = opt([], "tools the model may call: built-in names (calculator, python), "
                               "path/to/file.py:Class, or {name, class, description, parameters, kwargs}")
    max_turns: int = opt(4, "most model turns per trajectory")
    max_tool_calls: int = opt(8, "most tool calls per trajectory")
    max_tokens_per_turn: Optional[int] = opt(None, "most tokens per model turn; null = data.max_response_length "
                                                   "(which bounds all turns together)")
    timeout_s: float = opt(30.0, "time limit of one environment step or tool call, in seconds; with a runner, "
                                 "the most it may spend between two of its requests (and before the first, "
                                 "after the last)")
    runner: Optional[str] = opt(None, "agent code run against the OpenAI-compatible endpoint: path/to/file.py:fn, "
                                      "`async def fn(client, row, **env_kwargs)` returning the reward or {reward, "
                                      "metrics}; null = none")
    verifiers: Optional[str] = opt(None, "a verifiers environment run through the endpoint: an installed "
                                         "environment id or path/to/file.py (its load_environment(**env_kwargs)); "
                                         "null = none")
    gym: Optional[str] = opt(None, "a Gymnasium-style text environment played through the endpoint: "
                                   "module:Class, path/to/file.py:Class or textarena:<env id>; null = none")
    openenv: Optional[str] = opt(None, "an OpenEnv environment played through the endpoint, by its HTTP client: "
                                       "module:ClientClass or path/to/file.py:ClientClass (env_kwargs: base_url "
                                       "and the action's text field); null = none")
    images: Optional[bool] = opt(None, "the endpoint's requests may carry images (image_url parts): the model "
                                       "runs as the vision-language model it is, on the vision engine; needs an "
                                       "endpoint way in (agent.runner, agent.verifiers, agent.gym, agent.openenv); "
                                       "null = follows the model: true for a vision-language model (Qwen2.5-VL, "
                                       "Qwen3-VL, Gemma 3), false for a text model and for a Qwen3.5 checkpoint as "
                                       "published (its language model trains alone, on the fast engine; true "
                                       "makes it the vision-language model: "
                                       "docs/agents.md#images-vision-language-models)")
    max_concurrent_requests: int = opt(1024, "requests the endpoint serves at once (more wait their turn); a "
                                             "trajectory holding a KV slot is served past it")
    runner_processes: Optional[int] = opt(None, "processes the endpoint's agent code runs in, trajectories dealt "
                                                "round-robin (an OpenAI client spends milliseconds of CPU per "
                                                "request); null = min(16, CPU cores)")
