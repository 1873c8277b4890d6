"""The reasoning-gym reward: each task scores its own answers with the task's ``score_answer``.

reasoning-gym tasks (arithmetic, puzzles, games...) know how to grade an answer, often with partial
credit, given the task's *entry* (question, answer, metadata). The entry travels in the row's
``extra_info``, in either of these forms:

- ``extra_info["reasoning_gym"] = {"dataset": "basic_arithmetic", "entry": {...}}``
- ``extra_info["entry"] = {...}`` with the task name in ``entry["metadata"]["source_dataset"]``
  (what ``reasoning_gym.create_dataset`` produces), or in the data source ``reasoning_gym/<task>``.

The answer is the text inside the last ``<answer>...</answer>`` when the response has one (the tag
reasoning-gym's prompts ask for), else the whole stripped response. reasoning-gym is imported on first
use (``pip install reasoning-gym``, or ``hybridflow[gym]``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from hybridflow.rewards.registry import register_reward


@functools.lru_cache(maxsize=None)
def _score_answer_fn(dataset: str) -> Callable[[str | None, dict], float]:
    from reasoning_gym.factory import get_score_answer_fn

    return get_score_answer_fn(dataset)


def extract_tagged_answer(solution_str: str, tag: str = "answer") -> str:
    """The text in the last ``<tag>...</tag>`` of `solution_str`, else the whole stripped string."""
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", solution_str, flags=re.DOTALL)
    return (matches[-1] if matches else solution_str).strip()


def _task_and_entry(data_source: str, ground_truth: Any, extra_info: Any) -> tuple[str, dict]:
    info = extra_info if isinstance(extra_info, dict) else {}
    nested = info.get("reasoning_gym")
    if isinstance(nested, dict):
        entry, dataset = nested.get("entry"), nested.get("dataset")
    else:
        entry, dataset = info.get("entry"), None
    if not isinstance(entry, dict):
        raise ValueError(
            "the reasoning_gym reward needs the task entry in extra_info: "
            "extra_info['reasoning_gym'] = {'dataset': name, 'entry': {...}} or extra_info['entry'] = {...}; "
            f"got extra_info keys {sorted(info)}"
        )
    dataset = dataset or (entry.get("metadata") or {}).get("source_dataset")
    if not dataset and "/" in str(data_source):
        dataset = str(data_source).split("/", 1)[1]
    if not dataset:
        raise ValueError(
            f"cannot tell the reasoning-gym task for data_source {data_source!r}: give "
            "extra_info['reasoning_gym']['dataset'], entry['metadata']['source_dataset'] or "
            "data_source 'reasoning_gym/<task>'"
        )
    if "answer" not in entry and ground_truth is not None:
        entry = {**entry, "answer": ground_truth}
    return dataset, entry


@register_reward("reasoning_gym", requires=("reasoning_gym", "reasoning-gym>=0.1.20"))
def reasoning_gym_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                         answer_tag: str = "answer") -> float:
    """The task's own ``score_answer(answer, entry)`` (a float in [0, 1])."""
    dataset, entry = _task_and_entry(data_source, ground_truth, extra_info)
    return float(_score_answer_fn(dataset)(extract_tagged_answer(solution_str, answer_tag), entry))
