"""TRL's config names in a hybridflow command get their hybridflow key as the did-you-mean (issue 55), per
command: `beta` is the KL coefficient of `hybridflow train` and `dpo.beta` of `hybridflow dpo`, never the
spelling neighbour `actor.betas`."""

from __future__ import annotations

import pytest

from hybridflow import cli
from hybridflow.config.loader import ConfigError, load_config, schema_fields
from hybridflow.config.preference_schema import DPOConfig
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.trl_keys import TRL_KEYS


@pytest.mark.parametrize("schema, item, expected", [
    (RLConfig, "beta=0.04", "unknown key 'beta': TRL's name; in hybridflow it is 'actor.kl_loss_coef' (GRPO's KL "
                            "coefficient (0: no reference model))"),
    (DPOConfig, "beta=0.1", "unknown key 'beta': TRL's name; in hybridflow it is 'dpo.beta'"),
    (RLConfig, "num_generations=8", "unknown key 'num_generations': TRL's name; in hybridflow it is 'rollout.n'"),
    (RLConfig, "max_completion_length=256", "in hybridflow it is 'data.max_response_length'"),
    (DPOConfig, "max_completion_length=256", "in hybridflow it is 'data.max_length' (it bounds prompt + completion"),
    (RLConfig, "max_prompt_length=128", "in hybridflow it is 'data.max_prompt_length'"),
    (RLConfig, "learning_rate=1e-6", "unknown key 'learning_rate': TRL's name; in hybridflow it is 'actor.lr'"),
    (SFTConfig, "learning_rate=1e-5", "in hybridflow it is 'optim.lr'"),
    (RLConfig, "per_device_train_batch_size=8", "in hybridflow it is 'data.train_batch_size' (prompts per step"),
    (SFTConfig, "gradient_accumulation_steps=4", "in hybridflow it is 'data.train_batch_size'"),
    (SFTConfig, "num_train_epochs=3", "in hybridflow it is 'trainer.total_epochs'"),
    (RLConfig, "epsilon=0.2", "in hybridflow it is 'actor.clip_low'"),
    (RLConfig, "loss_type=dr_grpo", "in hybridflow it is 'actor.loss_agg' (grpo = seq-mean-token-mean"),
    (DPOConfig, "loss_type=ipo", "in hybridflow it is 'dpo.loss_type'"),
    (RLConfig, "actor.learning_rate=1e-6", "unknown key 'actor.learning_rate': TRL's name; in hybridflow it is "
                                           "'actor.lr'"),
    (SFTConfig, "use_vllm=true", "unknown key 'use_vllm': TRL's name; hybridflow has no key for it: rollout uses"),
    (SFTConfig, "num_generations=4", "unknown key 'num_generations': TRL's name; this command has no equivalent "
                                     "(elsewhere: 'rollout.n')"),
])
def test_a_trl_name_is_answered_with_the_commands_own_key(schema, item, expected):
    with pytest.raises(ConfigError) as err:
        load_config([item], schema=schema)
    assert expected in str(err.value)
    assert "actor.betas" not in str(err.value) or "adam_beta" in item


def test_every_key_the_table_names_exists_in_some_command():
    keys = set().union(*(schema_fields(s) for s in (RLConfig, SFTConfig, DPOConfig)))
    named = {ours for candidates in TRL_KEYS.values() for ours, _ in candidates if ours is not None}
    assert named - keys == set()


def test_hybridflow_dpo_refuses_beta_naming_dpo_beta(capsys):
    assert cli.main(["dpo", "model.path=unused", "data.train_files=unused.jsonl", "beta=0.1"]) == 2
    assert "unknown key 'beta': TRL's name; in hybridflow it is 'dpo.beta'" in capsys.readouterr().err
