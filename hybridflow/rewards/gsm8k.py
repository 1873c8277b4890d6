"""The GSM8K reward: the number after ``####`` (strict) or the last number (flexible) against the answer.

Extraction follows verl's ``gsm8k.py`` so scores carry over: ``strict`` requires the model to write
``#### <number>`` (the format GSM8K solutions use) and takes the last such number; ``flexible`` takes
the last number anywhere in the response. Numbers are compared after removing thousands separators,
``$`` and a trailing ``.``, and numerically when both sides parse (so ``72.0`` equals ``72``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from hybridflow.rewards.registry import register_reward

EXTRACTION_METHODS = ("strict", "flexible")
# Regexes over very long strings are slow and the answer sits at the end: only the tail is searched.
_TAIL_CHARS = 300
_STRICT = re.compile(r"#### *(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9][$0-9.,]*")


def _normalize(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final numeric answer in `solution_str`, or None when there is none.

    Args:
        solution_str: the model's response text.
        method: ``strict`` (the last ``#### <number>``) or ``flexible`` (the last number).
    """
    if method not in EXTRACTION_METHODS:
        raise ValueError(f"gsm8k extraction method {method!r} is unknown; valid: {', '.join(EXTRACTION_METHODS)}")
    tail = solution_str[-_TAIL_CHARS:]
    pattern = _STRICT if method == "strict" else _NUMBER
    for match in reversed(pattern.findall(tail)):
        number = _normalize(match)
        if number not in ("", "-", "."):
            return number
    return None


def answers_match(answer: str, ground_truth: str) -> bool:
    """True when the two number strings are equal, numerically if both parse."""
    if answer == ground_truth:
        return True
    try:
        return Decimal(answer) == Decimal(ground_truth)
    except InvalidOperation:
        return False


@register_reward("gsm8k")
def gsm8k_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                 method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for a correct answer, `format_score` for a wrong but extractable one, else 0.

    `ground_truth` is the final number (verl's parquet) or a full GSM8K solution ending in ``#### n``.
    """
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    truth = _normalize(truth.strip())
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answers_match(answer, truth) else float(format_score)
