"""The environment of recipes/multiturn_retry.yaml: "answer, get feedback, retry" on GSM8K-style rows.

After each model turn it extracts the final number (the GSM8K reward's `flexible` extraction by default:
the last number; `strict`: the last "#### <number>"). Right: the episode ends with reward
`decay ** turn` (1 for a first-try answer, 0.5 for the second with decay 0.5, ...). Wrong or missing:
no reward, and a user message asking to check the work and answer again.
"""

from __future__ import annotations

from typing import Any

from hybridflow.agents import Environment, EnvStep
from hybridflow.rewards.gsm8k import extract_answer, gsm8k_reward


class FeedbackRetry(Environment):
    """kwargs: decay (reward factor per extra attempt), method (answer extraction: flexible or strict)."""

    def __init__(self, row: dict[str, Any], decay: float = 0.5, method: str = "flexible") -> None:
        super().__init__(row, decay=decay, method=method)
        self.truth, self.decay, self.method = row["ground_truth"], float(decay), method

    def step(self, text: str, turn: int) -> EnvStep:
        if gsm8k_reward("openai/gsm8k", text, self.truth, method=self.method) == 1.0:
            return EnvStep(None, reward=self.decay ** turn)
        answer = extract_answer(text, self.method)
        problem = "I could not find a final answer" if answer is None else f"{answer} is not right"
        return EnvStep(f"{problem}. Check your work and answer again, ending with \"#### <number>\".")
