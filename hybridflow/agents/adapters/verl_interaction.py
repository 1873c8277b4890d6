"""verl's interactions, unchanged: a `BaseInteraction` subclass, or verl's interaction config YAML, as
`agent.environment`, called with its own method names.

    agent.environment=my_interactions.py:Gsm8kInteraction        # one class, built with config {}
    agent.environment=interaction_config.yaml                     # verl's file:
    #   interaction:
    #     - name: gsm8k
    #       class_name: my_interactions.Gsm8kInteraction          # dotted, or file.py:Class
    #       config: {}

The interaction is built once per process (``cls(config)``; ``config["name"]`` set from the entry). Each
trajectory picks it by its row's ``extra_info.interaction_kwargs.name`` (a class named directly serves every
row; so does a config's only entry for rows naming none), then: ``start_interaction(None, **interaction_kwargs)`` before its first step; after each model turn
``generate_response(instance_id, messages, **interaction_kwargs)`` with the conversation so far (the
prompt's messages, the model's turns as ``assistant``, the interaction's as ``user``), whose
``(should_terminate, response, score, data)`` becomes an `EnvStep` (score as its reward, the response as the
next user message unless it terminates; another shape, or a response that is not a str when it goes on, is
an environment error naming the class, never the text "None" sent to the model); ``finalize_interaction``
when the trajectory ends. The interaction_kwargs are `agent.env_kwargs` updated by the row's.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hybridflow.agents.adapters.verl_tools import load_class, read_config
from hybridflow.agents.loop.environment import Environment, EnvStep


def is_verl_interaction(cls: Any) -> bool:
    """A class with verl's interaction methods (and no `step` of ours)."""
    return (isinstance(cls, type) and not callable(getattr(cls, "step", None))
            and all(callable(getattr(cls, m, None)) for m in ("start_interaction", "generate_response")))


async def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
    result = method(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def _takes_instance(method: Any) -> bool:
    """verl's base `finalize_interaction()` takes nothing; its examples take the instance id."""
    params = [p for p in inspect.signature(method).parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return bool(params)


class VerlInteraction(Environment):
    """An `Environment` driving verl interactions (see the module docstring); `interactions` maps each name to
    the class and config it is built from, once per process."""

    interactions: dict[str, tuple[type, dict[str, Any]]] = {}
    by_name = True  # rows pick their interaction by interaction_kwargs.name (a config file's entries)
    _built: dict[str, Any] = {}

    def __init__(self, row: dict[str, Any], **interaction_kwargs: Any) -> None:
        super().__init__(row, **interaction_kwargs)
        name = interaction_kwargs.get("name")
        if len(self.interactions) == 1 and (name is None or not self.by_name):
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise KeyError(f"the row's interaction_kwargs.name={name!r} names none of the interactions "
                           f"{sorted(self.interactions)}")
        if name not in self._built:
            cls, config = self.interactions[name]
            self._built[name] = cls({**config, "name": name})
        self.interaction, self.instance_id = self._built[name], None
        prompt = row.get("raw_prompt")
        self.messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    async def step(self, text: str, turn: int) -> EnvStep:
        if self.instance_id is None:
            self.instance_id = await _call(self.interaction.start_interaction, None, **self.kwargs)
        self.messages.append({"role": "assistant", "content": text})
        returned = await _call(self.interaction.generate_response, self.instance_id, list(self.messages),
                               **self.kwargs)
        owner = f"{type(self.interaction).__name__}.generate_response"
        if not isinstance(returned, tuple) or len(returned) < 3:
            raise TypeError(f"{owner} returned {returned!r:.80}: expected verl's (should_terminate, response, score, "
                            f"data)")
        done, response, score, *_ = returned
        if not done and not isinstance(response, str):
            raise TypeError(f"{owner} returned the response {response!r:.80} with should_terminate=False: the next "
                            f"user message must be a str")
        if not done:
            self.messages.append({"role": "user", "content": response})
        return EnvStep(None if done else response, role="user", reward=float(score or 0.0), done=bool(done))

    async def close(self) -> None:
        finalize = getattr(self.interaction, "finalize_interaction", None)
        if self.instance_id is not None and callable(finalize):
            await _call(finalize, *([self.instance_id] if _takes_instance(finalize) else []))


def interaction_environment(interactions: dict[str, tuple[type, dict[str, Any]]], by_name: bool = True) -> type:
    """A `VerlInteraction` class of its own for these interactions (name -> (class, config)); `by_name` false:
    every row gets the one interaction, whatever its interaction_kwargs.name says."""
    return type("VerlInteraction", (VerlInteraction,), {"interactions": dict(interactions), "by_name": by_name,
                                                       "_built": {}})


def load_interaction_config(path: str, where: str) -> type:
    """The environment class of verl's interaction config YAML (see the module docstring)."""
    interactions = {}
    for i, entry in enumerate(read_config(path, "interaction", where)):
        at = f"{where} ({path}, interaction[{i}])"
        cls = load_class(entry["class_name"], Path(path).parent, at)
        if not is_verl_interaction(cls):
            raise TypeError(f"{at}: {entry['class_name']} has no start_interaction / generate_response methods; a "
                            f"verl BaseInteraction subclass was expected")
        name = entry.get("name") or (entry.get("config") or {}).get("name") or cls.__name__
        interactions[name] = (cls, dict(entry.get("config") or {}))
    return interaction_environment(interactions)
