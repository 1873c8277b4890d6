"""TRL's reward-function shapes beyond the plain batched one, through `Scorer` and `RewardManager` (issue 55):
``async def`` functions awaited concurrently under the reward timeout, a function taking only
``completion_ids``, ``log_extra`` / ``log_metric`` reaching the result, functions named by import path
(TRL's own ``trl.rewards.accuracy_reward`` on conversational completions), and verl scorers whose response
parameter is ``model_output`` or ``predict_str`` called by position. The user functions are doubles written
here from TRL's and verl's public signatures."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.rewards import RewardManager, RewardSpec, Scorer

SHAPES = """
    import asyncio

    STARTED = {"rows": 0, "judge": False}
    ALL_ROWS = None

    async def per_row_judge(data_source, solution_str, ground_truth, extra_info=None):
        # returns only once every row's call has started: awaited one after another, it would never return
        global ALL_ROWS
        ALL_ROWS = ALL_ROWS or asyncio.Event()
        STARTED["rows"] += 1
        if STARTED["rows"] == 3:
            ALL_ROWS.set()
        await ALL_ROWS.wait()
        return {"score": float(solution_str == ground_truth), "judged": 1}

    async def batched_judge(prompts, completions, log_metric, log_extra, **kwargs):
        # waits for per_row_judge's rows: the two functions are awaited together
        while ALL_ROWS is None or not ALL_ROWS.is_set():
            await asyncio.sleep(0.01)
        log_metric("judge_calls", 1.0)
        log_extra("verdict", ["long" if len(c[0]["content"]) > 2 else "short" for c in completions])
        return [0.5] * len(completions)

    async def hangs(completions, **kwargs):
        await asyncio.sleep(3600)

    async def raises_on_x(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "x":
            raise RuntimeError("judge unavailable")
        return 1.0

    def by_ids(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]
"""

PACKAGE = """
    def compute_score(model_output: str, ground_truth: str, timeout_score: float = 0) -> float:
        return float(model_output.strip() == ground_truth)

    def geo3k_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1):
        return float(ground_truth in predict_str)
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package `hf_test_trl` with modules `shapes` (SHAPES) and `math_verify` (PACKAGE, verl's
    reward_score modules' shape). Functions sharing state are named by import path: a file is executed anew
    for each function named in it, an imported module once."""
    pkg = tmp_path / "pkgs" / "hf_test_trl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "shapes.py").write_text(textwrap.dedent(SHAPES))
    (pkg / "math_verify.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))  # spawned scoring processes get the parent's sys.path
    yield "hf_test_trl"
    for name in [m for m in sys.modules if m.startswith("hf_test_trl")]:
        del sys.modules[name]


def step_batch(texts, truths, columns=None):
    """Rows as the trainer scores them: chat prompts, decoded responses, their ids, the dataset columns."""
    n = len(texts)
    responses = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 10]][:n])
    attention = torch.cat([torch.ones(n, 2, dtype=torch.long), (responses > 0).long()], dim=1)
    return Batch({"responses": responses, "attention_mask": attention},
                 {"raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)], "response_text": texts,
                  "data_source": ["toy"] * n, "ground_truth": truths, "extra_info": [None] * n,
                  "columns": columns or [{} for _ in range(n)]})


def test_async_functions_are_awaited_together_across_rows_and_functions(package):
    specs = [f"{package}.shapes:per_row_judge", f"{package}.shapes.batched_judge"]
    with RewardManager(specs, num_workers=1, timeout_s=20, weights=[1.0, 2.0]) as manager:
        result = manager.score(step_batch(["42", "7", "abc"], ["42", "8", "abc"]))
    assert result.errors == [None] * 3
    assert result.scores == [2.0, 1.0, 2.0]
    assert result.metrics["reward/per_row_judge/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/batched_judge/mean"] == 0.5
    assert result.metrics["reward/judged/mean"] == 1.0  # a dict result's extra
    assert result.metrics["reward/judge_calls"] == 1.0  # log_metric
    assert result.extras["verdict"] == ["short", "short", "long"]  # log_extra, a column per row


def test_an_async_function_past_the_timeout_fails_its_rows_and_one_that_raises_only_its_row(package):
    shapes = f"{package}.shapes"
    with RewardManager(f"{shapes}:hangs", num_workers=1, timeout_s=0.5, fallback_score=-1.0) as manager:
        result = manager.score(step_batch(["a", "b"], ["a", "b"]))
    assert result.scores == [-1.0, -1.0] and result.metrics["reward/timeouts"] == 1
    assert result.errors[0] == "timeout: no result within 0.5 s"
    with RewardManager([f"{shapes}:raises_on_x", f"{shapes}:by_ids"], num_workers=0) as manager:
        result = manager.score(step_batch(["x", "y"], ["x", "y"]))
    assert result.errors == ["error: reward function 'raises_on_x': RuntimeError: judge unavailable", None]
    assert result.scores == [0.0, 1.0 + 1.0]


def test_get_reward_fn_refuses_an_async_function_it_cannot_await(package):
    from hybridflow.rewards import get_reward_fn

    with pytest.raises(TypeError, match=r"reward function hf_test_trl.shapes:raises_on_x is `async def`: "
                                        r"RewardManager and the trainer await it"):
        get_reward_fn(f"{package}.shapes:raises_on_x")


def test_a_function_taking_only_completion_ids_is_batched_and_gets_them(tmp_path):
    shapes = tmp_path / "shapes.py"  # by file this time
    shapes.write_text(textwrap.dedent(SHAPES))
    scorer = Scorer(RewardSpec.of(f"{shapes}:by_ids"))
    assert scorer.batched == [0] and not scorer.has_row_functions
    with RewardManager(f"{shapes}:by_ids", num_workers=0) as manager:
        assert manager.score(step_batch(["a", "b", "c"], [None] * 3)).scores == [2.0, 1.0, 3.0]


def test_trls_accuracy_reward_by_import_path_on_conversational_completions():
    pytest.importorskip("math_verify")
    columns = [{"solution": r"\frac{1}{3}"}, {"solution": r"\frac{1}{3}"}]
    with RewardManager("trl.rewards.accuracy_reward", num_workers=0) as manager:
        result = manager.score(step_batch([r"So \boxed{\frac{1}{3}}", r"So \boxed{\frac{1}{2}}"], [None, None], columns))
    assert result.errors == [None, None] and result.scores == [1.0, 0.0]


def test_verl_scorers_by_import_path_get_the_response_by_position(package):
    scorer_package = f"{package}.math_verify"
    for spec in (f"{scorer_package}.compute_score", f"{scorer_package}:geo3k_score"):
        scorer = Scorer(RewardSpec.of(spec))
        assert scorer.score_row(("geo3k", "12", "12", None)) == (1.0, {})
        assert scorer.parts[0].binding.positional == ("solution_str",) and scorer.names("ground_truth")
    with pytest.raises(AttributeError, match=r"reward function reward.function='hf_test_trl.math_verify.compute_scor"
                                             r"': module 'hf_test_trl.math_verify' has no 'compute_scor'; did you "
                                             r"mean 'compute_score'\?"):
        Scorer(RewardSpec.of(f"{scorer_package}.compute_scor"))
    with pytest.raises(ImportError, match=r"reward.function='no_such_pkg.scores.fn': cannot import module "
                                          r"'no_such_pkg.scores' \(No module named 'no_such_pkg'\)"):
        Scorer(RewardSpec.of("no_such_pkg.scores.fn"))
