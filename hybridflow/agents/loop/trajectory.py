"""`Trajectory`: one multi-turn episode as the trainer gets it, token ids that are never re-tokenized.

After the prompt come alternating model turns (the exact sampled ids, their log-probs, mask 1) and
environment / tool turns (the chat template's rendering of the new messages only, log-prob 0, mask
0). `token_ids`, `logprobs` and `response_mask` cover all of them, so the rollout worker lays a
trajectory out like a single-turn completion, with holes in the mask. The in-process loop continues the
batch's prompt; the OpenAI-compatible endpoint's trajectories bring their own (`prompt_ids`: the first
request's rendering) and start a new segment (`start_segment`) when a request does not continue the
last one. A vision-language model's trajectory (the endpoint's) keeps the images its ids hold (`vision`), in the
order of their tokens, prompt and environment turns alike, for the trainer's forward. `dropped` says why a
trajectory must not be trained on (its runner failed). `row_fields()` are
the per-row statistics the trainer turns into `agent/...` metrics; `reward_info()` is what reward
functions see in `extra_info`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.data.image_prompts import VisionInputs
from hybridflow.engine.rollout import Completion

STAT_FIELDS = ("turns", "tool_calls", "tool_errors", "env_errors", "env_seconds", "env_reward", "cut_by_budget",
               "kv_reused_tokens", "segments", "token_mismatch", "runner_errors", "late_requests")


@dataclass
class Trajectory:
    """token_ids / logprobs / response_mask: the response after the prompt, all turns; messages: the
    turns as chat messages (model turns as `assistant`); finish_reason: the last model turn's, or
    "length" when the token budget cut the episode. The rest are the episode's statistics:
    kv_reused_tokens counts the cached tokens continuations attended over instead of prefilling;
    env_error is the environment's first failure (None when it never failed).
    Endpoint trajectories also have: prompt_ids (None: the batch row's prompt), segments (token sequences
    started; only the last is kept), token_mismatch (1 when the ids differ from the chat template's
    rendering of the final conversation), runner_errors / late_requests (the runner failed; a request
    came after it returned), dropped (why it must not be trained on, None when it may) and metrics
    (what the runner returned beside the reward); a vision-language model's also vision (the images of its
    current segment, None when it holds none)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    env_seconds: float = 0.0
    env_reward: float = 0.0
    cut_by_budget: bool = False
    kv_reused_tokens: int = 0
    prompt_ids: list[int] | None = None
    segments: int = 0
    token_mismatch: int = 0
    runner_errors: int = 0
    late_requests: int = 0
    dropped: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    env_error: str | None = None
    vision: VisionInputs | None = None

    def env_failed(self, message: str) -> None:
        """The environment failed (its constructor or a step raised or timed out): counted, the first
        message kept (the trainer names it when every trajectory of several steps fails)."""
        self.env_errors += 1
        if self.env_error is None:
            self.env_error = message

    def start_segment(self, prompt_ids: list[int], vision: VisionInputs | None = None) -> None:
        """A new token sequence from `prompt_ids`, whose images are `vision` (what came before is no longer its
        prefix)."""
        self.prompt_ids, self.token_ids, self.logprobs, self.response_mask = list(prompt_ids), [], [], []
        self.vision = vision
        self.segments += 1

    def drop(self, reason: str) -> None:
        """Not to be trained on (the first reason is kept)."""
        self.dropped = self.dropped or reason

    def add_model_turn(self, completion: Completion, text: str | None = None) -> None:
        """The sampled ids and log-probs of a model turn (and its text as an assistant message, when given)."""
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.response_mask += [1] * len(completion.token_ids)
        if text is not None:
            self.messages.append({"role": "assistant", "content": text})
        self.finish_reason = completion.finish_reason
        self.turns += 1

    def add_env_turn(self, token_ids: list[int], messages: list[dict[str, Any]] | None = None,
                     vision: VisionInputs | None = None) -> None:
        """Context ids (masked out of training), their messages and the images they hold."""
        if vision is not None:
            self.vision = vision if self.vision is None else VisionInputs.concat([self.vision, vision])
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.response_mask += [0] * len(token_ids)
        self.messages += messages or []

    def cut(self) -> None:
        """The token budget ended the episode."""
        self.cut_by_budget, self.finish_reason = True, "length"

    def row_fields(self) -> dict[str, float]:
        """`agent/<stat>` per-row values (see STAT_FIELDS)."""
        return {f"agent/{name}": float(getattr(self, name)) for name in STAT_FIELDS}

    def reward_info(self) -> dict[str, Any]:
        """Added to the row's `extra_info` for reward functions: the turns as messages, the number of
        model turns and the environment's (and tools') summed reward."""
        info = {"messages": self.messages, "num_turns": self.turns, "env_reward": self.env_reward}
        return {**info, "runner_metrics": dict(self.metrics)} if self.metrics else info
