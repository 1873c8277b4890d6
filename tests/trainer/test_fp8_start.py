"""`hybridflow train` with `rollout.quantization=fp8` on the CPU stops with exit status 2 and the keys to change,
before any model loads (the FP8 rollout runs on CUDA sm_89+; docs/rollout.md#fp8-rollout)."""

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
