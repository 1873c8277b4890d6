"""`agent.openenv`: an OpenEnv environment server played by the policy through the endpoint, by its client.

    agent.openenv: openenv.core:GenericEnvClient      # or the environment's own client: my_env.client:MyEnv
    agent.env_kwargs:
      base_url: http://127.0.0.1:8000                 # where the environment server runs
      action_field: message                           # the action's text field (default: message)
      observation_field: echoed_message               # the observation's text field (null: all of it, as JSON)
      action: my_env.models:MyAction                  # build actions of this class (default: plain dicts)

Per trajectory: a client session (`async with Client(base_url=...)`), `reset(seed=<the row's
extra_info.seed, else its index>)`, the conversation is the row's prompt (a string is a system message)
then the observation's text as a user message; each model answer becomes the action's text field, its
step's reward is added up and its observation is the next user message, until the step says done,
`agent.max_turns` answers or the trajectory's token budget is used up. Returns the summed reward and the `turns`. Needs `openenv-core` (the `agents`
extra), imported only in the runner process.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from hybridflow.agents.adapters.gym_runner import answer, conversation


def _load(spec: str) -> Any:
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        from hybridflow.utils.imports import load_from_file

        return load_from_file(spec, "openenv", "class", "agent.openenv")
    return getattr(importlib.import_module(target), name)


def _text(observation: Any, field: str | None) -> str:
    data = observation.model_dump() if hasattr(observation, "model_dump") else observation
    if field is not None:
        return str(data[field])
    return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, default=str)


async def run(client: Any, row: dict[str, Any], client_class: str, env_kwargs: dict[str, Any],
              max_turns: int = 4) -> dict[str, Any]:
    """One episode on the OpenEnv server `env_kwargs["base_url"]` through `client_class`."""
    kwargs = dict(env_kwargs)
    if "base_url" not in kwargs:
        raise ValueError("agent.openenv needs agent.env_kwargs.base_url: where the environment server runs")
    base_url, field = kwargs.pop("base_url"), kwargs.pop("action_field", "message")
    observed, action_spec = kwargs.pop("observation_field", None), kwargs.pop("action", None)
    make_action = _load(action_spec) if action_spec else dict
    seed = (row.get("extra_info") or {}).get("seed", row.get("index"))
    total, turns = 0.0, 0
    async with _load(client_class)(base_url=base_url, **kwargs) as env:
        result = await env.reset(**({} if seed is None else {"seed": int(seed)}))
        messages = [*conversation(row.get("raw_prompt")), {"role": "user", "content": _text(result.observation,
                                                                                             observed)}]
        while turns < max_turns and not result.done:
            text = await answer(client, messages)
            if text is None:
                break
            messages.append({"role": "assistant", "content": text})
            turns += 1
            result = await env.step(make_action(**{field: text}))
            total += float(result.reward or 0.0)
            messages.append({"role": "user", "content": _text(result.observation, observed)})
    return {"reward": total, "metrics": {"turns": float(turns)}}
