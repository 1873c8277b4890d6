"""Rollout correction weights and metrics against hand-computed values; weighting the advantage weights the
token's policy loss for every built-in loss."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import ROLLOUT_CORRECTIONS, compute_policy_loss, rollout_correction

# pi_train / pi_rollout per token; the last token of row 1 is padding (its ratio must not count).
RATIOS = [[3.0, 0.25, 1.5], [0.8, 0.4, 9.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def _logps():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -1.2]], dtype=torch.float64)
    return rollout + torch.tensor(RATIOS, dtype=torch.float64).log(), rollout


def _run(mode, **options):
    train, rollout = _logps()
    weights, metrics = rollout_correction(mode, train, rollout, MASK, **options)
    return (weights * MASK).flatten().tolist(), {k: float(v) for k, v in metrics.items()}


CASES = {
    # mode, options: (weights on real tokens, metrics)
    ("token_tis", ()): ([[2.0, 0.25, 1.5], [0.8, 0.4, 0.0]],
                        {"rollout_is_mean": 4.95 / 5, "rollout_is_ratio_fraction_high": 1 / 5}),
    # rows: 3 * 0.25 * 1.5 = 1.125 and 0.8 * 0.4 = 0.32 (the padding's 9 left out)
    ("seq_tis", ()): ([[1.125] * 3, [0.32, 0.32, 0.0]],
                      {"rollout_is_mean": (3 * 1.125 + 2 * 0.32) / 5, "rollout_is_ratio_fraction_high": 0.0}),
    ("seq_tis", (("threshold", 1.0),)): ([[1.0] * 3, [0.32, 0.32, 0.0]],
                                         {"rollout_is_mean": (3 + 0.64) / 5,
                                          "rollout_is_ratio_fraction_high": 3 / 5}),
    # kept range [0.5, 2]: 3 is above, 0.25 and 0.4 below
    ("token_mis", ()): ([[0.0, 0.0, 1.5], [0.8, 0.0, 0.0]],
                        {"rollout_is_mean": 2.3 / 5, "rollout_is_ratio_fraction_high": 1 / 5,
                         "rollout_is_ratio_fraction_low": 2 / 5, "rollout_rs_masked_fraction": 3 / 5}),
    ("seq_mis", ()): ([[1.125] * 3, [0.0, 0.0, 0.0]],
                      {"rollout_is_mean": 3 * 1.125 / 5, "rollout_is_ratio_fraction_high": 0.0,
                       "rollout_is_ratio_fraction_low": 2 / 5, "rollout_rs_masked_fraction": 2 / 5}),
    ("seq_mis", (("threshold_lower", 0.3),)): ([[1.125] * 3, [0.32, 0.32, 0.0]],
                                               {"rollout_is_mean": (3 * 1.125 + 0.64) / 5,
                                                "rollout_is_ratio_fraction_high": 0.0,
                                                "rollout_is_ratio_fraction_low": 0.0,
                                                "rollout_rs_masked_fraction": 0.0}),
    # AReaL's decoupled weight: 3 is above the cap and dropped, the small ratios are kept (no lower edge)
    ("decoupled", ()): ([[0.0, 0.25, 1.5], [0.8, 0.4, 0.0]],
                        {"rollout_is_mean": 2.95 / 5, "rollout_is_ratio_fraction_high": 1 / 5,
                         "rollout_is_ratio_fraction_low": 0.0, "rollout_rs_masked_fraction": 1 / 5}),
    ("none", ()): ([[1.0] * 3, [1.0, 1.0, 0.0]], {}),
}


@pytest.mark.parametrize("mode, options", list(CASES), ids=[f"{m}{dict(o)}" for m, o in CASES])
def test_weights_and_metrics_match_hand_computed_values(mode, options):
    want_weights, want_metrics = CASES[(mode, options)]
    weights, metrics = _run(mode, **dict(options))
    assert weights == pytest.approx([w for row in want_weights for w in row], abs=1e-12)
    assert metrics == pytest.approx(want_metrics, abs=1e-12)


def test_weights_are_detached_and_sequence_ratios_do_not_overflow():
    rollout = torch.zeros(1, 400)
    train = torch.full((1, 400), 0.5, requires_grad=True)  # log ratio of the row: 200 -> clamped to 20
    weights, metrics = rollout_correction("seq_tis", train, rollout, torch.ones(1, 400), threshold=5.0)
    assert not weights.requires_grad and torch.all(weights == 5.0)
    weights, metrics = rollout_correction("seq_mis", train, rollout, torch.ones(1, 400), threshold=1e12)
    assert torch.all(weights == 0.0) and metrics["rollout_rs_masked_fraction"] == 1.0  # e^200 > 1e12
    assert torch.isfinite(weights).all()


def test_bad_bounds_are_refused():
    train, rollout = _logps()
    with pytest.raises(ValueError, match="threshold must be > 0"):
        rollout_correction("token_tis", train, rollout, MASK, threshold=0.0)
    with pytest.raises(ValueError, match="threshold_lower < threshold"):
        rollout_correction("token_mis", train, rollout, MASK, threshold=2.0, threshold_lower=3.0)
    with pytest.raises(ValueError, match="token_tis"):
        rollout_correction("token_tsi", train, rollout, MASK)
    assert list(ROLLOUT_CORRECTIONS) == ["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "decoupled"]


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_weighting_the_advantage_weights_the_tokens_policy_loss(loss, agg):
    """For token (i, t) and weight w: L(A with A_it -> w A_it) - L(A_it -> 0) = w (L(A) - L(A_it -> 0)), i.e.
    the correction's weight on the advantage multiplies exactly that token's term of the policy loss."""
    g = torch.Generator().manual_seed(0)
    old, logp = -torch.rand(3, 4, generator=g, dtype=torch.float64), -torch.rand(3, 4, generator=g,
                                                                                dtype=torch.float64)
    adv, mask = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    opts = dict(clip_low=0.2, clip_high=0.2, agg=agg) if loss != "gspo" else dict(clip_low=0.05, clip_high=0.05)

    def value(scale):
        a = adv.clone()
        a[1, 2] *= scale
        return float(compute_policy_loss(loss, old, logp, a, mask, **opts)[0])

    for w in (0.0, 0.37, 2.0):
        assert value(w) - value(0.0) == pytest.approx(w * (value(1.0) - value(0.0)), rel=1e-9, abs=1e-12)
    assert not math.isclose(value(1.0), value(0.0))  # the token contributes, so the check is not vacuous
