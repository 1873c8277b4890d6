"""`hybridflow train` with each `actor.rollout_correction.mode` on the tiny model: the mismatch metrics are
logged every step and each correction changes the gradient exactly as its weights say.

Engine and trainer agree to ~1e-6 in fp32, so ρ = π_train/π_rollout ≈ 1 on every token: a truncation
point of 0.5 weighs every token 0.5 (half the gradient of no correction), a kept range of [0.25, 0.5]
drops every token (no gradient), and the default bounds keep every token at weight ≈ 1.
"""

from __future__ import annotations

import pytest

from rl_helpers import run

REWARD = "def char_reward(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return sum(map(ord, solution_str)) % 7 / 7.0\n"
MISMATCH = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
            "training/rollout_actor_probs_pearson_corr", "rollout_corr/kl", "rollout_corr/k3_kl",
            "rollout_corr/log_prob_abs_diff_mean")


@pytest.fixture(scope="module")
def one_step(tiny_qwen2, data_dir, tmp_path_factory):
    """`one_step(*overrides)` -> the metrics of one GRPO step with a reward that varies within groups."""
    reward = tmp_path_factory.mktemp("reward") / "char_reward.py"
    reward.write_text(REWARD)

    def step(*overrides):
        out = tmp_path_factory.mktemp("run")
        rows = run(tiny_qwen2, data_dir, out, f"reward.function={reward}:char_reward", "trainer.total_steps=1",
                   "trainer.val_before_train=false", "trainer.val_every=0", *overrides)
        return rows[-1]

    return step


@pytest.fixture(scope="module")
def uncorrected(one_step):
    return one_step()


def test_mismatch_metrics_every_step_and_near_zero_in_fp32(uncorrected):
    for key in MISMATCH:
        assert key in uncorrected, key
    assert uncorrected["training/rollout_probs_diff_max"] < 1e-4
    assert abs(uncorrected["rollout_corr/k3_kl"]) < 1e-8
    assert uncorrected["training/rollout_actor_probs_pearson_corr"] > 0.9999
    assert uncorrected["actor/grad_norm"] > 0 and "rollout_corr/rollout_is_mean" not in uncorrected


@pytest.mark.parametrize("mode, overrides, grad_scale, metrics", [
    # old log-probs from their own forward pass here: the trainer side of the ratio is then old_log_probs
    ("token_tis", ["actor.rollout_correction.threshold=0.5", "actor.skip_old_log_probs=false"], 0.5,
     {"rollout_corr/rollout_is_mean": 0.5, "rollout_corr/rollout_is_ratio_fraction_high": 1.0}),
    ("seq_tis", ["actor.rollout_correction.threshold=0.5"], 0.5,
     {"rollout_corr/rollout_is_mean": 0.5, "rollout_corr/rollout_is_ratio_fraction_high": 1.0}),
    ("token_mis", ["actor.rollout_correction.threshold=0.5", "actor.rollout_correction.threshold_lower=0.25"], 0.0,
     {"rollout_corr/rollout_is_mean": 0.0, "rollout_corr/rollout_rs_masked_fraction": 1.0}),
    ("seq_mis", [], 1.0, {"rollout_corr/rollout_is_mean": 1.0, "rollout_corr/rollout_rs_masked_fraction": 0.0}),
])
def test_each_correction_scales_the_gradient_as_its_weights_say(one_step, uncorrected, mode, overrides, grad_scale,
                                                                metrics):
    row = one_step(f"actor.rollout_correction.mode={mode}", *overrides)
    assert row["actor/grad_norm"] == pytest.approx(grad_scale * uncorrected["actor/grad_norm"], rel=1e-3, abs=1e-9)
    for key, value in metrics.items():
        assert row[key] == pytest.approx(value, abs=1e-4), key
    assert row["training/rollout_probs_diff_max"] < 1e-4
