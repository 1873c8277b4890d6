"""The reward registry: `auto` routing, registration, user files and their error messages."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.rewards import REWARD_FUNCTIONS, get_reward_fn, register_reward, route_data_source, split_result
from hybridflow.rewards.registry import REQUIREMENTS


@pytest.mark.parametrize(
    "data_source, name",
    [
        ("openai/gsm8k", "gsm8k"),
        ("gsm8k_test", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("math_dapo", "math"),
        ("aime_2024", "math"),
        ("reasoning_gym/basic_arithmetic", "reasoning_gym"),
    ],
)
def test_auto_routes_by_data_source(data_source, name):
    assert route_data_source(data_source) == name


def test_auto_unknown_data_source_names_it_and_the_choices():
    with pytest.raises(ValueError, match=r"no reward for data_source 'my/secret_task'.*gsm8k"):
        route_data_source("my/secret_task")
    auto = get_reward_fn("auto")
    assert auto("openai/gsm8k", "#### 4", "4", None) == 1.0
    assert auto("lighteval/MATH", "$\\frac{1}{2}$", "0.5", None) == 1.0


def test_unknown_name_suggests_close_match():
    with pytest.raises(ValueError, match=r"did you mean 'gsm8k'.*valid: auto"):
        get_reward_fn("gsm8kk")


def test_register_reward_makes_a_name_usable():
    @register_reward("test_length")
    def length_reward(data_source, solution_str, ground_truth, extra_info):
        return len(solution_str) / 10

    try:
        assert get_reward_fn("test_length")("d", "abcde", None, None) == 0.5
    finally:
        REWARD_FUNCTIONS.pop("test_length")


def _write(path, body):
    path.write_text(textwrap.dedent(body))
    return path


def test_a_reward_file_slow_to_import_is_named_while_it_runs(tmp_path, monkeypatch, caplog):
    """A start-up held in a reward file's module-level code says which file holds it."""
    import logging

    from hybridflow.utils import imports

    monkeypatch.setattr(imports, "SLOW_IMPORT_S", 0.05)
    f = _write(tmp_path / "slow_reward.py", """
        import time
        time.sleep(0.5)

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    with caplog.at_level(logging.WARNING):
        get_reward_fn(f"{f}:compute_score")
    assert (f"still importing reward file {f} (reward.function='{f}:compute_score') after 0.05 s: its module-level "
            f"code is running" in caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        get_reward_fn(f"{_write(tmp_path / 'quick.py', 'def compute_score(solution_str): return 1.0')}:compute_score")
    assert "still importing" not in caplog.text


def test_user_file_function(tmp_path):
    f = _write(tmp_path / "my_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}

        NOT_CALLABLE = 3
    """)
    fn = get_reward_fn(f"{f}:compute_score")
    assert fn("d", "x", "x", None) == {"score": 1.0, "length": 1}
    assert get_reward_fn(f"{f}:compute_score", {"bonus": 0.5})("d", "x", "y", None)["score"] == 0.5
    with pytest.raises(AttributeError, match=r"no function 'compute_scor'; did you mean 'compute_score'"):
        get_reward_fn(f"{f}:compute_scor")
    with pytest.raises(TypeError, match="is a int, not a function"):
        get_reward_fn(f"{f}:NOT_CALLABLE")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_reward_fn(f"{tmp_path}/missing.py:compute_score")
    with pytest.raises(TypeError, match=r"do not fit reward function .* it takes no parameter 'other'"):
        get_reward_fn(f"{f}:compute_score", {"other": 1})


def test_a_parameter_no_name_fills_is_refused_naming_it(tmp_path):
    f = _write(tmp_path / "bad.py", """
        def two_args(solution, truth):
            return 1.0

        def positional(a, b, c, d):
            return 2.0
    """)
    # the first parameter is the response, by position (verl's model_output / predict_str); the second has none
    with pytest.raises(TypeError, match=r"two_args \(signature \(solution, truth\)\): its parameter 'truth' has no "
                                        r"value to take; hybridflow passes data_source, solution_str, ground_truth, "
                                        r"extra_info by keyword \(and the response by position to a first parameter"):
        get_reward_fn(f"{f}:two_args")
    with pytest.raises(TypeError, match=r"its parameter 'b' has no value"):  # only the first is filled by position
        get_reward_fn(f"{f}:positional")


def test_verls_own_scorer_shape_gets_the_response_and_the_ground_truth(tmp_path):
    """verl's `reward_score/gsm8k.py` shape: `compute_score(solution_str, ground_truth, method, format_score,
    score)`, no data_source. Called positionally it got data_source as the response (issue 36)."""
    f = _write(tmp_path / "gsm8k_like.py", """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            assert method in ("strict", "flexible"), method
            answer = solution_str.split("####")[-1].strip() if "####" in solution_str else None
            if answer is None:
                return 0.0
            return score if answer == ground_truth else format_score
    """)
    fn = get_reward_fn(f"{f}:compute_score")
    assert fn("openai/gsm8k", "so 3 + 4 #### 7", "7", {"index": 0}) == 1.0
    assert fn("openai/gsm8k", "#### 8", "7", None) == 0.0
    tuned = get_reward_fn(f"{f}:compute_score", {"method": "flexible", "format_score": 0.1, "score": 2.0})
    assert tuned("openai/gsm8k", "#### 7", "7", None) == 2.0 and tuned("x", "#### 8", "7", None) == 0.1


def test_split_result_validates():
    assert split_result(1) == (1.0, {})
    assert split_result({"score": 0.5, "acc": True, "pred": ["x"]}) == (0.5, {"acc": True, "pred": "['x']"})
    with pytest.raises(ValueError, match="no 'score' key"):
        split_result({"acc": 1.0})
    with pytest.raises(TypeError, match="must be a number"):
        split_result("1.0")
    with pytest.raises(ValueError, match="not finite"):
        split_result(float("nan"))


def test_a_missing_optional_package_is_refused_early_with_the_install_command(monkeypatch):
    from hybridflow.rewards import RewardManager

    @register_reward("test_needs_pkg", requires=("hybridflow_no_such_module", "no-such-package>=1"))
    def needs(data_source, solution_str, ground_truth, extra_info):
        return 1.0

    monkeypatch.setattr("hybridflow.rewards.registry.AUTO_ROUTES", [("needs*", "test_needs_pkg")])
    try:
        with pytest.raises(ImportError, match=r"needs the hybridflow_no_such_module module: pip install 'no-such-package>=1'"):
            get_reward_fn("test_needs_pkg")
        manager = RewardManager("auto", num_workers=0)
        with pytest.raises(ImportError, match="pip install 'no-such-package>=1'"):
            manager.check_data_sources(["needs_it"])
    finally:
        REWARD_FUNCTIONS.pop("test_needs_pkg")
        REQUIREMENTS.pop("test_needs_pkg")


def test_register_route_is_tried_first(monkeypatch):
    from hybridflow.rewards import register_route
    from hybridflow.rewards.registry import AUTO_ROUTES

    monkeypatch.setattr("hybridflow.rewards.registry.AUTO_ROUTES", list(AUTO_ROUTES))
    register_route("GSM8K_Strings*", "exact_match")
    assert route_data_source("gsm8k_strings_v2") == "exact_match"
    assert route_data_source("gsm8k_main") == "gsm8k"


def test_keyword_only_and_reordered_parameters_are_called_by_name(tmp_path):
    f = _write(tmp_path / "kw.py", """
        def keyword_only(*, data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return float(solution_str == ground_truth) + bonus

        def reordered(ground_truth, solution_str, data_source, extra_info):
            return {"score": float(solution_str == ground_truth), "source": data_source}
    """)
    assert get_reward_fn(f"{f}:keyword_only")("d", "x", "x", None) == 1.0
    assert get_reward_fn(f"{f}:keyword_only", {"bonus": 0.5})("d", "x", "y", None) == 0.5
    assert get_reward_fn(f"{f}:reordered")("d", "x", "x", None) == {"score": 1.0, "source": "d"}
    with pytest.raises(TypeError, match=r"reward kwargs \{'other': 1\} do not fit reward function"):
        get_reward_fn(f"{f}:keyword_only", {"other": 1})
