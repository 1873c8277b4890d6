"""Metric helpers on a hand-made batch: lengths, rewards, masked advantages, timings, throughput."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.tracking import (
    compute_data_metrics,
    compute_throughput,
    compute_timing_metrics,
    compute_validation_metrics,
    timer,
)


def _batch() -> Batch:
    # 2 rows; prompt width 3 (left-padded), response width 4 (right-padded).
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    token_scores = torch.zeros(2, 4)
    token_scores[0, 1], token_scores[1, 3] = 1.0, -0.5
    advantages = torch.tensor([[2.0, 4.0, 100.0, 100.0], [-1.0, 0.0, 1.0, 6.0]])
    return Batch(tensors={
        "prompts": torch.ones(2, 3, dtype=torch.long),
        "responses": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, response_mask.long()], dim=1),
        "response_mask": response_mask,
        "token_scores": token_scores,
        "token_rewards": token_scores - 0.1 * response_mask,
        "advantages": advantages,
        "returns": advantages * 2,
    })


def test_data_metrics_on_a_hand_made_batch():
    m = compute_data_metrics(_batch())
    assert m["response_length/mean"] == 3.0 and m["response_length/max"] == 4.0 and m["response_length/min"] == 2.0
    assert m["response_length/clip_ratio"] == 0.5  # row 1 fills all 4 positions
    assert m["prompt_length/mean"] == 2.5 and m["prompt_length/max"] == 3.0
    assert m["reward/mean"] == 0.25 and m["reward/max"] == 1.0 and m["reward/min"] == -0.5
    assert m["reward/with_kl/mean"] == pytest.approx(0.25 - 0.1 * 3)
    # Padding (the 100s) is excluded: mean of [2, 4, -1, 0, 1, 6].
    assert m["advantages/mean"] == pytest.approx(2.0) and m["advantages/max"] == 6.0 and m["advantages/min"] == -1.0
    assert m["returns/mean"] == pytest.approx(4.0)
    assert "values/mean" not in m
    assert compute_data_metrics(_batch(), max_response_length=8)["response_length/clip_ratio"] == 0.0


def test_data_metrics_accept_a_plain_mapping():
    b = _batch()
    m = compute_data_metrics({k: b[k] for k in ("prompts", "attention_mask", "response_mask")})
    assert m["response_length/mean"] == 3.0 and "reward/mean" not in m


def test_timer_and_timing_metrics():
    timings: dict[str, float] = {}
    with timer("gen", timings):
        pass
    first = timings["gen"]
    with timer("gen", timings):
        pass
    assert timings["gen"] >= first > 0  # repeated blocks add up
    m = compute_timing_metrics({"gen": 0.6, "update_actor": 1.1, "step": 2.0}, _batch())
    assert m["timing_s/gen"] == 0.6 and m["timing_s/step"] == 2.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(1000 * 0.6 / 6)  # 6 response tokens
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(1000 * 1.1 / 11)  # 5 prompt + 6 response
    assert "timing_per_token_ms/step" not in m
    assert compute_timing_metrics({"gen": 1.0}) == {"timing_s/gen": 1.0}


def test_throughput_per_device():
    m = compute_throughput(_batch(), step_time=2.0, n_gpus=2)
    assert m["perf/throughput"] == pytest.approx(11 / 2.0 / 2)
    assert m["perf/total_num_tokens"] == 11
    with pytest.raises(ValueError, match="step_time must be > 0"):
        compute_throughput(_batch(), step_time=0.0)


def test_validation_metrics_per_data_source():
    m = compute_validation_metrics(["gsm8k", "math", "gsm8k"], [1.0, 0.0, 0.0], {"acc": [True, None, False]})
    assert m["val/reward/mean"] == pytest.approx(1 / 3)
    assert m["val/gsm8k/reward/mean"] == 0.5 and m["val/math/reward/mean"] == 0.0
    assert m["val/acc/mean"] == 0.5 and "val/math/acc/mean" not in m
