"""The exact-match reward: the (optionally extracted) response equals the ground truth after stripping.

For tasks whose answers are short strings (the CPU demo's string tasks, classification labels). With
``marker`` set (e.g. ``"####"`` or ``"Answer:"``) only the text after the last marker is compared;
a response without the marker scores 0.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.registry import register_reward


@register_reward("exact_match")
def exact_match_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                       marker: str | None = None, case_sensitive: bool = True) -> float:
    """1.0 when ``strip(answer) == strip(ground_truth)``, else 0.0."""
    answer = solution_str
    if marker:
        if marker not in answer:
            return 0.0
        answer = answer.rsplit(marker, 1)[1]
    answer, truth = answer.strip(), str(ground_truth).strip()
    if not case_sensitive:
        answer, truth = answer.casefold(), truth.casefold()
    return 1.0 if answer == truth else 0.0
