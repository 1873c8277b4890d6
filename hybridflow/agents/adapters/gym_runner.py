"""`agent.gym`: a Gymnasium-style text environment played by the policy through the endpoint.

    agent.gym: my_envs.py:Maze            # or a module: my_package.envs:Maze, or textarena:GuessTheNumber-v0
    agent.env_kwargs: {size: 5}           # the environment's constructor arguments

The environment is Gymnasium's protocol with text spaces: `reset(seed=...) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)`, where the action is the model's
answer and observations are text (a `gymnasium.Env` subclass, or any class with these methods). For a
vision-language model an observation may also be an image (a PIL image, or an H x W x 3 uint8 array as
Gymnasium's image spaces give) or a `{"text": ..., "image": ...}` mapping: the user message then carries the
image as an `image_url` part (a PNG data URI), the text after it. A `textarena:<env id>` spec makes that
textarena game (`textarena.make`) for one player through `TextArenaGym`, whose observations are what the game
added since the last one.

Per trajectory: one environment, reset with the row's `extra_info.seed` (else its index); the
conversation is the row's prompt (a string is a system message), then the observation as a user message;
each model answer is a step, its reward added up, its observation the next user message, until
terminated, truncated, `agent.max_turns` answers or the trajectory's token budget is used up. Returns the
summed reward and the `turns`.
This module runs in the runner process (`runner_child`); Gymnasium itself is not needed.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import io
from typing import Any

from hybridflow.agents.endpoint.openai_wire import MODEL_NAME

_classes: dict[str, Any] = {}


class TextArenaGym:
    """A single-player textarena game behind the Gymnasium protocol (see the module docstring)."""

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        import textarena

        self.game = textarena.make(env_id=env_id, **kwargs)
        self.seen = ""

    def _observation(self) -> str:
        _, text = self.game.get_observation()
        text = text if isinstance(text, str) else str(text)
        new = text[len(self.seen):] if text.startswith(self.seen) else text
        self.seen = text
        return new.strip()

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.game.reset(num_players=1, seed=seed)
        self.seen = ""
        return self._observation(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        done, info = self.game.step(action)
        if not done:
            return self._observation(), 0.0, False, False, dict(info or {})
        rewards, game_info = self.game.close()
        return "", float((rewards or {}).get(0, 0.0)), True, False, dict(game_info or {})


def environment_class(spec: str) -> Any:
    """The class (or factory) of an `agent.gym` spec, loaded once per process."""
    if spec not in _classes:
        target, _, name = spec.rpartition(":")
        if target == "textarena":
            _classes[spec] = lambda **kwargs: TextArenaGym(name, **kwargs)
        elif target.endswith(".py"):
            from hybridflow.utils.imports import load_from_file

            _classes[spec] = load_from_file(spec, "gym environment", "class", "agent.gym")
        else:
            _classes[spec] = getattr(importlib.import_module(target), name)
    return _classes[spec]


async def answer(client: Any, messages: list[dict[str, Any]]) -> str | None:
    """The model's answer to `messages`; None when the trajectory's context is used up (the episode ends)."""
    import openai

    try:
        reply = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
    except openai.BadRequestError as e:
        if getattr(e, "code", None) == "context_length_exceeded":
            return None
        raise
    return reply.choices[0].message.content or ""


def _image_url(image: Any) -> dict[str, Any]:
    """A PIL image or an H x W x 3 uint8 array as an `image_url` part holding a PNG data URI."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _is_image(value: Any) -> bool:
    if type(value).__module__.startswith("PIL."):
        return True
    shape = getattr(value, "shape", None)  # a numpy image, without importing numpy for text environments
    return shape is not None and len(shape) == 3 and shape[-1] == 3 and str(getattr(value, "dtype", "")) == "uint8"


def observation_message(observation: Any) -> dict[str, Any]:
    """An observation as a user message: text, or an image (alone or as `{"text", "image"}`) as an image part."""
    if _is_image(observation):
        return {"role": "user", "content": [_image_url(observation)]}
    if isinstance(observation, dict) and _is_image(observation.get("image")):
        text = observation.get("text")
        parts = [_image_url(observation["image"])] + ([{"type": "text", "text": str(text)}] if text else [])
        return {"role": "user", "content": parts}
    return {"role": "user", "content": str(observation)}


def conversation(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "system", "content": prompt}] if prompt else []
    return [{"role": m["role"], "content": m["content"]} for m in prompt or []]


async def run(client: Any, row: dict[str, Any], env: str, env_kwargs: dict[str, Any] | None = None,
              max_turns: int = 4) -> dict[str, Any]:
    """One episode of `env` (an `agent.gym` spec) for `row`; see the module docstring."""
    instance = environment_class(env)(**(env_kwargs or {}))
    seed = (row.get("extra_info") or {}).get("seed", row.get("index"))
    observation, _ = await asyncio.to_thread(instance.reset, seed=None if seed is None else int(seed))
    messages = [*conversation(row.get("raw_prompt")), observation_message(observation)]
    total, turns = 0.0, 0
    try:
        while turns < max_turns:
            action = await answer(client, messages)
            if action is None:
                break
            messages.append({"role": "assistant", "content": action})
            turns += 1
            observation, reward, terminated, truncated, _ = await asyncio.to_thread(instance.step, action)
            total += float(reward)
            if terminated or truncated:
                break
            messages.append(observation_message(observation))
    finally:
        if callable(getattr(instance, "close", None)) and not isinstance(instance, TextArenaGym):
            instance.close()
    return {"reward": total, "metrics": {"turns": float(turns)}}
