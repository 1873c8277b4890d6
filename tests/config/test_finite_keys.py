"""Every float key of every config kind (RL, SFT, DPO, reward model) refuses NaN, +inf and -inf with the key named
(issue 56): one rule over the dataclasses, so a key added later is covered without a line here; and the commands
refuse such a value before any model loads."""

from __future__ import annotations

import pytest

from hybridflow import cli
from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.loader import schema_fields
from hybridflow.config.preference_schema import DPOConfig, RewardModelTrainConfig
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.validate import validate_sft
from hybridflow.trainer import rl, single_model

SCHEMAS = (RLConfig, SFTConfig, DPOConfig, RewardModelTrainConfig)


def _float_keys(schema: type) -> list[tuple[str, bool]]:
    """(key, is a list) of every key whose type holds a float."""
    return [(key, info.kind == "list") for key, info in schema_fields(schema).items()
            if info.kind in ("scalar", "list") and "float" in str(info.type)]


CASES = [(schema, key, is_list) for schema in SCHEMAS for key, is_list in _float_keys(schema)]


def test_the_enumeration_finds_the_keys_of_the_issue():
    keys = {(schema.__name__, key) for schema, key, _ in CASES}
    for key in ("actor.grad_clip", "actor.clip_low", "rollout.temperature", "reward.fallback_score",
                "teacher.kl_coef", "actor.kl_loss_coef", "actor.betas", "reward.weights"):
        assert ("RLConfig", key) in keys
    assert ("DPOConfig", "dpo.beta") in keys and ("RewardModelTrainConfig", "optim.grad_clip") in keys
    assert ("SFTConfig", "optim.grad_clip") in keys and ("RewardModelTrainConfig", "rm.center_coef") in keys


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("schema,key,is_list", CASES, ids=[f"{s.__name__}:{k}" for s, k, _ in CASES])
def test_a_non_finite_float_is_refused_naming_the_key(schema, key, is_list, value):
    cfg = load_config([f"{key}=[1.0,{value}]" if is_list else f"{key}={value}"], schema=schema)
    with pytest.raises(ConfigError) as e:
        if schema is RLConfig:
            validate(cfg, check_paths=False)
        else:
            validate_sft(cfg)
    assert f"{key}=" in str(e.value) and "must be a finite number" in str(e.value)
    assert str(e.value).count("\n  - ") == 1  # refused alone: no range check runs on it


@pytest.mark.parametrize("command,key", [("train", "actor.grad_clip"), ("dpo", "optim.grad_clip"),
                                         ("rm", "optim.grad_clip"), ("sft", "optim.grad_clip")])
def test_the_commands_refuse_nan_before_models_load(command, key, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
    monkeypatch.setattr(single_model.SingleModelTrainer, "__init__",
                        lambda *a, **k: pytest.fail("started a trainer before refusing"))
    assert cli.main([command, f"{key}=nan", f"trainer.output_dir={tmp_path}"]) == 2
    assert f"{key}=nan must be a finite number" in capsys.readouterr().err
