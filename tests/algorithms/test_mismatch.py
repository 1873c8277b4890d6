"""Training–inference mismatch metrics against hand-computed values; pieces merge to the whole."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import merge_mismatch_stats, mismatch_metrics, mismatch_stats, training_rollout_mismatch


def _probs():
    """Token probabilities of the trainer and of the rollout engine; row 1's last token is padding."""
    p_train = torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.6, 0.1]], dtype=torch.float64)
    p_rollout = torch.tensor([[0.4, 0.25, 0.9], [0.5, 0.6, 0.7]], dtype=torch.float64)
    return p_train, p_rollout, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_metrics_match_hand_computed_values():
    p_train, p_rollout, mask = _probs()
    m = training_rollout_mismatch(p_train.log(), p_rollout.log(), mask)
    real = [(0.5, 0.4), (0.2, 0.25), (0.9, 0.9), (0.4, 0.5), (0.6, 0.6)]
    diffs = [abs(a - b) for a, b in real]  # 0.1, 0.05, 0, 0.1, 0
    mean = sum(diffs) / 5
    r = [a / b for a, b in real]
    xs, ys = [a for a, _ in real], [b for _, b in real]
    mx, my = sum(xs) / 5, sum(ys) / 5
    cov = sum((x - mx) * (y - my) for x, y in real) / 5
    corr = cov / math.sqrt(sum((x - mx) ** 2 for x in xs) / 5 * sum((y - my) ** 2 for y in ys) / 5)
    want = {
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_max": 0.1,
        "training/rollout_probs_diff_std": math.sqrt(sum((d - mean) ** 2 for d in diffs) / 5),
        "training/rollout_actor_probs_pearson_corr": corr,
        "rollout_corr/kl": sum(math.log(b) - math.log(a) for a, b in real) / 5,
        "rollout_corr/k3_kl": sum(x - math.log(x) - 1 for x in r) / 5,
        "rollout_corr/log_prob_abs_diff_mean": sum(abs(math.log(a) - math.log(b)) for a, b in real) / 5,
        "rollout_corr/max_abs_logp_diff": max(abs(math.log(a) - math.log(b)) for a, b in real),
    }
    assert m == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert m["training/rollout_probs_diff_max"] < 0.6  # the padding token's |0.1 - 0.7| is left out


def test_pieces_merge_to_the_whole():
    p_train, p_rollout, mask = _probs()
    a, b = (mismatch_stats(p_train[i:i + 1].log(), p_rollout[i:i + 1].log(), mask[i:i + 1]) for i in (0, 1))
    whole = training_rollout_mismatch(p_train.log(), p_rollout.log(), mask)
    assert mismatch_metrics(merge_mismatch_stats(a, b)) == pytest.approx(whole, rel=1e-12)


def test_identical_log_probs_and_empty_masks():
    logp = torch.log(torch.tensor([[0.3, 0.6], [0.9, 0.2]]))
    m = training_rollout_mismatch(logp, logp, torch.ones(2, 2))
    assert m["training/rollout_probs_diff_max"] == 0 and m["rollout_corr/k3_kl"] == 0
    assert m["rollout_corr/max_abs_logp_diff"] == 0
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert training_rollout_mismatch(logp, logp, torch.zeros(2, 2)) == {}
    constant = training_rollout_mismatch(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    assert "training/rollout_actor_probs_pearson_corr" not in constant  # undefined without variance
