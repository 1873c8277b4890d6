"""`hybridflow train` runs GRPO on the real SmolLM2-135M-Instruct on CPU with recipes/gsm8k_smollm2.yaml (shrunk to
2 steps of 2 prompts x 2 samples): the loop works on a real 49k-vocabulary model, the flexible GSM8K reward
scores its answers, and in fp32 the engine's sampled log-probs agree with the trainer's."""

from __future__ import annotations

import math

import pytest

from hybridflow.cli import main as cli_main
from rl_helpers import read_metrics

pytestmark = pytest.mark.real_model


def test_two_grpo_steps_on_smollm2(smollm2, data_dir, tmp_path):
    cli_main(["train", "--config", "recipes/gsm8k_smollm2.yaml", f"model.path={smollm2}",
              f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
              "data.train_batch_size=2", "actor.mini_batch_size=2", "rollout.n=2", "data.max_response_length=16",
              "trainer.total_steps=2", "trainer.val_every=2", "trainer.val_before_train=false",
              "reward.num_workers=1", "trainer.device=cpu", f"trainer.output_dir={tmp_path}"])
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert math.isfinite(row[key]), key
        assert row["training/rollout_probs_diff_max"] < 1e-3
        assert abs(row["rollout_corr/k3_kl"]) < 1e-6
        assert row["training/rollout_actor_probs_pearson_corr"] > 0.999
    assert "val/reward/mean" in steps[-1]
    assert (tmp_path / "checkpoints").is_dir()
