"""The reward both frameworks use in bench/grpo_vs_trl.py: GSM8K-style answer match, plus a small
length-independent shaping term so groups are not all-zero on a random model (every group then has a
learning signal, as in a real run).

`reward` has verl's signature (hybridflow); `trl_reward` is the same function in TRL's calling convention.
"""

from __future__ import annotations

import re


def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    numbers = re.findall(r"-?\d+", solution_str)
    exact = 1.0 if numbers and numbers[-1] == str(ground_truth).strip() else 0.0
    digits = sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)
    return exact + 0.1 * digits


def trl_reward(completions, ground_truth, **kwargs) -> list[float]:
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [reward("bench", t, gt) for t, gt in zip(texts, ground_truth)]
