"""The math reward: the response's final answer checked for mathematical equivalence with `math-verify`.

``math_verify.parse`` extracts the answer (``\\boxed{...}``, ``$...$`` or a bare expression) from both
the ground truth and the response, and ``math_verify.verify`` compares them symbolically, so
``\\frac{1}{2}``, ``0.5`` and ``1/2`` are the same answer. A ground truth without ``$`` or ``\\boxed``
(the MATH parquet's plain ``\\frac{1}{2}``) is wrapped in ``\\boxed{}`` first, as verl does.
math-verify is imported on first use (``pip install math-verify``, or ``hybridflow[math]``).
"""

from __future__ import annotations

import threading
from typing import Any

from hybridflow.rewards.registry import register_reward


@register_reward("math", requires=("math_verify", "math-verify>=0.7"))
def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                timeout_s: int = 5) -> float:
    """1.0 when the response's answer equals `ground_truth` mathematically, else 0.0.

    `timeout_s` bounds parsing and verification (math-verify's own alarm; it works only on the main
    thread, elsewhere the reward manager's per-sample timeout is the bound).
    """
    import math_verify as mv

    truth = str(ground_truth)
    if "$" not in truth and "\\boxed" not in truth:
        truth = "\\boxed{" + truth + "}"
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(truth, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {ground_truth!r}")
    pred = mv.parse(solution_str, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0
