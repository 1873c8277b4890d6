"""The environment protocol: the other side of a multi-turn episode (a simulated user, a grader, a game).

    class Feedback(Environment):                  # agent.environment=path/to/file.py:Feedback
        def __init__(self, row, **kwargs):        # one instance per trajectory
            self.answer = row["ground_truth"]

        def step(self, text, turn):               # or async def; after each model turn
            if self.answer in text:
                return EnvStep(None, reward=1.0)  # no message: the episode ends
            return EnvStep("Not quite, try again.", role="user")

        def close(self):                          # optional, when the trajectory ends
            ...

`row` holds the prompt row's fields: raw_prompt, data_source, ground_truth, extra_info, ability, index.
kwargs: `agent.env_kwargs`, updated by those of the row's `extra_info.interaction_kwargs` (verl's field)
that the constructor takes (all of them when it takes ``**kwargs``); every key stays readable in
``row["extra_info"]["interaction_kwargs"]``, so verl's rows (``name``, ``query``, ``ground_truth``) reach a
constructor that declares none of them without a crash.
`step(text, turn)` gets the model turn's text (special tokens dropped) and its index (0 = the first
model turn) and returns an `EnvStep` (a plain string is a user message; None ends the episode). Its
`reward` adds to the trajectory's environment reward, which reward functions see. An exception or a
timeout ends that trajectory and counts in `agent/env_errors`; the run goes on. verl's interactions load
too, with their own method names (`hybridflow.agents.adapters.verl_interaction`).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from hybridflow.utils.imports import load_from_file


@dataclass
class EnvStep:
    """message: the next message (None: the episode ends); role: its chat role; reward: a reward
    contribution; done: end the episode after this step (a message given with it is logged, not sent)."""

    message: str | None = None
    role: str = "user"
    reward: float = 0.0
    done: bool = False


class Environment:
    """Base class of an environment (see the module docstring); subclassing it is optional."""

    def __init__(self, row: dict[str, Any], **kwargs: Any) -> None:
        self.row, self.kwargs = row, kwargs

    def step(self, text: str, turn: int) -> EnvStep | str | None | Awaitable[EnvStep | str | None]:
        raise NotImplementedError(f"{type(self).__name__} does not implement step(text, turn)")

    def close(self) -> None | Awaitable[None]:
        """Called once when the trajectory ends."""


def as_env_step(value: Any, where: str) -> EnvStep:
    """An `EnvStep` of plain types from what `step` returned; TypeError naming `where` for anything else."""
    if value is None:
        return EnvStep()
    if isinstance(value, str):
        return EnvStep(str(value))
    if not isinstance(value, EnvStep):
        raise TypeError(f"{where} returned a {type(value).__name__}; return an EnvStep, a str (a user message) "
                        f"or None (end the episode)")
    if value.message is not None and not isinstance(value.message, str) or not isinstance(value.role, str):
        raise TypeError(f"{where} returned an EnvStep whose message/role are not strings: {value!r:.120}")
    try:
        reward = float(value.reward)
    except (TypeError, ValueError):
        raise TypeError(f"{where} returned an EnvStep whose reward {value.reward!r:.40} is not a number") from None
    return EnvStep(None if value.message is None else str(value.message), str(value.role), reward, bool(value.done))


def environment_kwargs(env_class: type, env_kwargs: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The constructor's keyword arguments for one trajectory of `row` (see the module docstring)."""
    per_row = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
    try:
        params = inspect.signature(env_class).parameters
    except (TypeError, ValueError):
        return {**env_kwargs, **per_row}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {**env_kwargs, **per_row}
    return {**env_kwargs, **{k: v for k, v in per_row.items() if k in params}}


def load_environment(spec: str) -> type:
    """The environment class named by `path/to/file.py:Class` (`agent.environment`); a verl `BaseInteraction`
    class, or verl's interaction config YAML, comes wrapped (`hybridflow.agents.adapters.verl_interaction`)."""
    from hybridflow.agents.adapters.verl_interaction import (interaction_environment, is_verl_interaction,
                                                             load_interaction_config)
    from hybridflow.agents.adapters.verl_tools import is_config_file

    if is_config_file(spec):
        return load_interaction_config(spec, "agent.environment")
    cls = load_from_file(spec, "environment", "class", "agent.environment")
    if is_verl_interaction(cls):
        return interaction_environment({cls.__name__: (cls, {})}, by_name=False)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise TypeError(f"agent.environment={spec!r} must name a class with a step(text, turn) method "
                        f"(subclass hybridflow.agents.Environment)")
    return cls
