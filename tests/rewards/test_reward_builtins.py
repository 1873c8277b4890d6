"""Built-in reward functions: gsm8k extraction modes, math equivalence, reasoning-gym, exact match."""

from __future__ import annotations

import pytest

from hybridflow.rewards import get_reward_fn
from hybridflow.rewards.gsm8k import extract_answer


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("3 + 4 = 7 so #### 7", "7", "7"),
        ("the total is 1,000 dollars.", None, "1000"),
        ("#### $1,250.", "1250", "1250"),
        ("first #### 3 then #### -12", "-12", "-12"),
        ("no numbers here", None, None),
        ("#### 5 and then 6 more words", "5", "6"),
    ],
)
def test_gsm8k_extraction_strict_vs_flexible(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_gsm8k_scores_and_format_score():
    strict = get_reward_fn("gsm8k")
    assert strict("openai/gsm8k", "so #### 72", "72", None) == 1.0
    assert strict("openai/gsm8k", "so #### 72.0", "72", None) == 1.0  # numeric comparison
    assert strict("openai/gsm8k", "the answer is 72", "72", None) == 0.0  # strict needs ####
    flexible = get_reward_fn("gsm8k", {"method": "flexible"})
    assert flexible("openai/gsm8k", "the answer is 72", "72", None) == 1.0
    # A full GSM8K solution as ground truth works too.
    assert strict("openai/gsm8k", "#### 18", "She has 16 - 3 = <<16-3=13>>13 ... #### 18", None) == 1.0
    formatted = get_reward_fn("gsm8k", {"format_score": 0.1})
    assert formatted("openai/gsm8k", "#### 71", "72", None) == pytest.approx(0.1)
    assert formatted("openai/gsm8k", "seventy-two", "72", None) == 0.0
    with pytest.raises(ValueError, match="valid: strict, flexible"):
        get_reward_fn("gsm8k", {"method": "lenient"})("openai/gsm8k", "#### 1", "1", None)


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is $0.5$", "\\frac{1}{2}", 1.0),
        ("so \\boxed{\\frac{2}{4}}", "0.5", 1.0),
        ("so \\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("$\\frac{1}{3}$", "\\frac{1}{2}", 0.0),
        ("I do not know", "\\frac{1}{2}", 0.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ],
)
def test_math_equivalence(response, truth, expected):
    assert get_reward_fn("math")("lighteval/MATH", response, truth, None) == expected


def test_reasoning_gym_task_scored_right_and_wrong():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    fn = get_reward_fn("reasoning_gym")
    info = {"reasoning_gym": {"dataset": "basic_arithmetic", "entry": entry}}
    right = f"thinking... <answer>{entry['answer']}</answer>"
    assert fn("reasoning_gym", right, entry["answer"], info) == 1.0
    assert fn("reasoning_gym", "<answer>not a number</answer>", entry["answer"], info) == 0.0
    # The task can also come from the entry's own metadata.
    assert fn("reasoning_gym/basic_arithmetic", right, None, {"entry": entry}) == 1.0
    with pytest.raises(ValueError, match="needs the task entry in extra_info"):
        fn("reasoning_gym", right, entry["answer"], {"other": 1})


def test_exact_match_with_marker():
    fn = get_reward_fn("exact_match")
    assert fn("demo", "  abc \n", "abc", None) == 1.0
    assert fn("demo", "abd", "abc", None) == 0.0
    marked = get_reward_fn("exact_match", {"marker": "Answer:"})
    assert marked("demo", "work... Answer: abc", "abc", None) == 1.0
    assert marked("demo", "abc", "abc", None) == 0.0
    folded = get_reward_fn("exact_match", {"case_sensitive": False})
    assert folded("demo", "ABC", "abc", None) == 1.0
