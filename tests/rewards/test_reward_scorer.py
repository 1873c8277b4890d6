"""Batched (TRL-style) reward functions and several functions with weights: `Scorer` and `RewardManager` on
batches shaped like a training step's, with doubles written here from TRL's public signature."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.rewards import RewardManager, RewardSpec, Scorer

TRL_REWARDS = """
    SEEN = {}

    def solution_match(prompts, completions, completion_ids, solution, **kwargs):
        # TRL's shape: lists over the batch; conversational prompts give completions as messages
        SEEN.update(prompts=prompts, completions=completions, ids=completion_ids, kwargs=sorted(kwargs))
        return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]

    def length_penalty(completions, **kwargs):
        return [None if c[0]["content"] == "skip" else -0.1 * len(c[0]["content"]) for c in completions]

    def wrong_length(completions, **kwargs):
        return [1.0]

    def per_row(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        return {"score": float(solution_str == ground_truth) + bonus, "chars": len(solution_str)}
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(textwrap.dedent(TRL_REWARDS))
    return str(path)


def step_batch(texts, solutions):
    """Rows as the trainer scores them: chat prompts, decoded responses, their ids, the dataset columns."""
    n = len(texts)
    responses = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 10]][:n])
    attention = torch.cat([torch.ones(n, 2, dtype=torch.long), (responses > 0).long()], dim=1)
    return Batch({"responses": responses, "attention_mask": attention},
                 {"raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)], "response_text": texts,
                  "data_source": ["toy"] * n, "ground_truth": solutions, "extra_info": [{"index": i} for i in range(n)],
                  "columns": [{"solution": s, "data_source": "toy", "level": i} for i, s in enumerate(solutions)]})


def test_a_batched_function_gets_the_batch_once_with_chat_completions_and_the_columns(rewards_file):
    scorer = Scorer(RewardSpec.of(f"{rewards_file}:solution_match"))
    assert scorer.batched == [0] and not scorer.has_row_functions
    with RewardManager(f"{rewards_file}:solution_match", num_workers=0) as manager:
        result = manager.score(step_batch(["42", " 7 ", "x"], ["42", "7", "y"]))
    assert result.scores == [1.0, 1.0, 0.0] and result.errors == [None] * 3
    seen = manager.scorer.parts[0].binding.fn.__globals__["SEEN"]
    assert seen["prompts"][0] == [{"role": "user", "content": "q0"}]
    assert seen["completions"][1] == [{"role": "assistant", "content": " 7 "}]
    assert seen["ids"] == [[5, 6], [7], [8, 9, 10]]
    assert seen["kwargs"] == ["data_source", "extra_info", "ground_truth", "level", "log_extra", "log_metric"]


def test_several_functions_are_summed_with_their_weights_and_logged_each(rewards_file):
    specs = [f"{rewards_file}:per_row", f"{rewards_file}:solution_match", f"{rewards_file}:length_penalty"]
    with RewardManager(specs, num_workers=1, weights=[1.0, 2.0, 0.5], fn_kwargs={"bonus": 0.25}) as manager:
        result = manager.score(step_batch(["42", "skip"], ["42", "7"]))
    # row 0: per_row 1.25, solution_match 1, length_penalty -0.2; row 1: 0.25, 0, None (adds nothing)
    assert result.scores == pytest.approx([1.25 + 2.0 - 0.5 * 0.2, 0.25])
    assert result.metrics["reward/per_row/mean"] == pytest.approx(0.75)
    assert result.metrics["reward/solution_match/mean"] == 0.5
    assert result.metrics["reward/length_penalty/mean"] == pytest.approx(-0.2)
    assert result.metrics["reward/chars/mean"] == 3.0


def test_bad_batched_results_fail_their_rows_not_the_run(rewards_file):
    with RewardManager(f"{rewards_file}:length_penalty", num_workers=0) as manager:
        result = manager.score(step_batch(["skip", "ok"], ["a", "b"]))
    assert result.errors[0] == "error: every reward function returned None for this row" and result.errors[1] is None
    with RewardManager(f"{rewards_file}:wrong_length", num_workers=0) as manager:
        result = manager.score(step_batch(["a", "b"], ["a", "b"]))
    assert result.metrics["reward/error_share"] == 1.0
    assert "must return a list of 2 numbers (one per completion, None to skip one); it returned 1 values" in result.errors[0]


def test_parameters_and_kwargs_are_checked_when_the_functions_are_bound(rewards_file):
    scorer = Scorer(RewardSpec.of(f"{rewards_file}:solution_match"))
    assert scorer.missing_columns(["prompt", "answer"]) == ["solution_match: solution"]
    assert scorer.missing_columns(["solution"]) == []
    assert Scorer(RewardSpec.of(f"{rewards_file}:per_row")).names("ground_truth")
    with pytest.raises(TypeError, match=r"reward kwargs \['nobody'\] fit none of reward.functions"):
        Scorer(RewardSpec.of([f"{rewards_file}:per_row", "exact_match"], kwargs={"nobody": 1}))
    both = Scorer(RewardSpec.of([f"{rewards_file}:per_row", "exact_match"], kwargs={"bonus": 1.0, "marker": "A:"}))
    assert both.score_row(("toy", "A: x", "x", None)) == (1.0 + 1.0, {"chars": 4, "per_row": 1.0, "exact_match": 1.0})
    with pytest.raises(ValueError, match="reward.weights has 1 values for 2 reward.functions"):
        RewardSpec.of([f"{rewards_file}:per_row", "gsm8k"], [1.0])
