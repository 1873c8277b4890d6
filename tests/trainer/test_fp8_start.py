"""`hybridflow train` with `rollout.quantization=fp8` on the CPU stops with exit status 2 and the keys to change,
before any model loads (the FP8 rollout runs on CUDA sm_89+; docs/rollout.md#fp8-rollout); with that refusal lifted,
a tiny run trains through the FP8 engine's weight sync."""

from __future__ import annotations

import pytest

from hybridflow import cli
from hybridflow.trainer import rl


def test_train_refuses_fp8_on_the_cpu_before_any_model_loads(tiny_qwen2, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
    assert cli.main(["train", f"model.path={tiny_qwen2}", f"data.train_files={data_dir}/train.parquet",
                     "data.train_batch_size=2", "rollout.n=2", "trainer.device=cpu", "rollout.quantization=fp8",
                     f"trainer.output_dir={tmp_path}"]) == 2
    assert "rollout.quantization=fp8 with trainer.device=cpu" in capsys.readouterr().err


def test_an_fp8_rollout_trains_through_the_weight_sync_on_the_cpu(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    """The CPU refusal lifted for this test: the trainer's weights are synced into the FP8 buffers each step (torch's
    CPU `_scaled_mm` runs the FP8 GEMMs), the mismatch they add is measured and `token_tis`, which the correction
    mode follows to, weighs it. Measured here:
    max |Δ log-prob| ~0.015 each step with the FP8 rollout, ~1e-6 in fp32 without; 0.5 and 0.9 at steps 2 and 3 with
    the sync switched off (the trained weights move at this learning rate), so a sync that missed the FP8 buffers
    fails the bound."""
    from hybridflow.config import fp8_checks

    from rl_helpers import reward_file, run

    monkeypatch.setattr(fp8_checks, "_device_problems", lambda trainer: [])
    rows = run(tiny_qwen2, data_dir, tmp_path / "out", "rollout.quantization=fp8", "trainer.total_steps=3",
               "actor.lr=1e-2", "trainer.val_before_train=false",
               "trainer.val_every=0", f"reward.function={reward_file(tmp_path)}")
    assert len(rows) == 3
    for row in rows:
        assert 1e-3 < row["rollout_corr/max_abs_logp_diff"] < 0.1, row["rollout_corr/max_abs_logp_diff"]
        assert 0.9 < row["rollout_corr/rollout_is_mean"] < 1.1  # reported when a correction mode is on
        assert row["actor/grad_norm"] > 0
