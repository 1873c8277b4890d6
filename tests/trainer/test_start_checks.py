"""Checks a run makes before any model loads (issue 36, item 4): peft's target-module spellings (verl's default
`all-linear` accepted, a regular expression or a module the model lacks refused) and a missing optional package
(the W&B logger), each with exit status 2 and one line."""

from __future__ import annotations

import importlib.util

import pytest

from hybridflow import cli
from hybridflow.trainer import rl


def lora_cmd(model, data_dir, out, *extra):
    return ["train", "--config", "recipes/grpo.yaml", f"model.path={model}", f"data.train_files={data_dir}/train.parquet",
            "data.train_batch_size=2", "rollout.n=2", "actor.mini_batch_size=null", "actor.lora.rank=4",
            f"trainer.output_dir={out}", *extra]


def test_peft_target_spellings_are_accepted_or_refused_before_models_load(tiny_qwen2, data_dir, tmp_path,
                                                                           monkeypatch, capsys):
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: (_ for _ in ()).throw(SystemExit(9)))
    with pytest.raises(SystemExit) as started:  # all-linear (peft's and verl's default) passes every check
        cli.main(lora_cmd(tiny_qwen2, data_dir, tmp_path / "a", "actor.lora.target_modules=all-linear"))
    assert started.value.code == 9
    assert cli.main(lora_cmd(tiny_qwen2, data_dir, tmp_path / "b", "actor.lora.target_modules=.*proj")) == 2
    assert "actor.lora.target_modules: '.*proj' is not a module name; give module names (q_proj, mlp.down_proj, " \
           "...), or all-linear / [] alone for every linear layer" in capsys.readouterr().err
    assert cli.main(lora_cmd(tiny_qwen2, data_dir, tmp_path / "c", "actor.lora.target_modules=[q_proj,qkv_proj]")) == 2
    assert "actor.lora.target_modules: 'qkv_proj': no module has that name; valid: down_proj, gate_proj, k_proj" \
           in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_missing_logger_package_is_refused_before_models_load(tiny_qwen2, data_dir, chats, tmp_path, capsys,
                                                                command, monkeypatch):
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
    files = f"{data_dir}/train.parquet" if command == "train" else str(chats)
    assert cli.main([command, f"model.path={tiny_qwen2}", f"data.train_files={files}", "trainer.loggers=[console,wandb]",
                     f"trainer.output_dir={tmp_path}"]) == 2
    assert "trainer.loggers includes 'wandb' (set WANDB_MODE=offline to log without an account) needs the wandb " \
           "package: pip install 'wandb'" in capsys.readouterr().err


