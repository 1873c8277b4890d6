"""load_config: defaults, YAML, dotted overrides, did-you-mean, types, choices, to_yaml, config_diff."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hybridflow.config import ConfigError, RLConfig, config_diff, load_config, to_yaml
from hybridflow.config.options import opt


def test_defaults_are_typed_dataclasses():
    cfg = load_config([])
    assert isinstance(cfg, RLConfig)
    assert cfg.rollout.n == 1 and cfg.actor.lr == 1e-6 and cfg.critic.lr == 1e-5
    assert cfg.actor.betas == (0.9, 0.999)
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.critic.model.path is None and cfg.algorithm.kl_ctrl.kl_coef == 0.001


def test_overrides_lists_null_and_nested():
    cfg = load_config(["rollout.n=8", "data.train_files=[a.parquet,b.jsonl]", "trainer.loggers=[console]",
                       "actor.mini_batch_size=null", "algorithm.kl_ctrl.type=adaptive", "reward.kwargs.k=2",
                       "actor.betas=[0.8,0.95]", "reward.function=my_rewards.py:score"])
    assert cfg.rollout.n == 8
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]
    assert cfg.trainer.loggers == ["console"]
    assert cfg.actor.mini_batch_size is None
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.reward.kwargs == {"k": 2}
    assert cfg.actor.betas == (0.8, 0.95)
    assert cfg.reward.function == "my_rewards.py:score"


def test_single_path_becomes_a_list():
    assert load_config(["data.val_files=/data/x.parquet"]).data.val_files == ["/data/x.parquet"]


def test_yaml_then_overrides_in_order(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  n: 4\n  temperature: 0.7\ndata:\n  train_files: one.parquet\n")
    cfg = load_config(["rollout.n=6"], config_file=f)
    assert cfg.rollout.n == 6 and cfg.rollout.temperature == 0.7
    assert cfg.data.train_files == ["one.parquet"]
    argv_cfg = load_config(["--config", str(f), "rollout.n=2"])
    assert argv_cfg.rollout.n == 2 and argv_cfg.rollout.temperature == 0.7
    assert load_config([f"--config={f}"]).rollout.n == 4


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature'; did you mean 'rollout.temperature'\?"):
        load_config(["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.temperature'"):
        load_config(["actor.temperature=0.5"])  # right leaf, wrong section
    with pytest.raises(ConfigError, match=r"unknown key 'foo'; top-level sections: model, data"):
        load_config(["foo.bar=1"])


def test_base_files_layer_under_a_recipe(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "root.yaml").write_text("rollout:\n  n: 2\n  top_p: 0.9\n")
    (tmp_path / "mid.yaml").write_text("base: common/root.yaml\nrollout:\n  n: 4\nactor:\n  lr: 3.0e-6\n")
    top = tmp_path / "top.yaml"
    top.write_text("base: [mid.yaml]\nrollout:\n  n: 8\n")
    cfg = load_config(["actor.lr=1e-5"], config_file=top)
    assert (cfg.rollout.n, cfg.rollout.top_p, cfg.actor.lr) == (8, 0.9, 1e-5)
    (tmp_path / "common" / "root.yaml").write_text("rollout:\n  nn: 2\n")
    with pytest.raises(ConfigError, match=r"root.yaml: unknown key 'rollout.nn'; did you mean 'rollout.n'"):
        load_config([], config_file=top)
    (tmp_path / "common" / "root.yaml").write_text("base: ../top.yaml\n")
    with pytest.raises(ConfigError, match="'base' files form a cycle"):
        load_config([], config_file=top)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor:\n  learning_rate: 1e-5\n")
    with pytest.raises(ConfigError) as e:
        load_config([], config_file=f)
    assert str(f) in str(e.value) and "unknown key 'actor.learning_rate'" in str(e.value)


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"invalid value 'abc' for 'rollout.n': expected int"):
        load_config(["rollout.n=abc"])
    with pytest.raises(ConfigError, match=r"'rollout' is a section"):
        load_config(["rollout=3"])
    with pytest.raises(ConfigError, match=r"not of the form key=value"):
        load_config(["rollout.n"])


def test_wrong_type_names_its_source(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("rollout:\n  n: many\n")
    with pytest.raises(ConfigError, match=rf"config file {f}: invalid value 'many' for 'rollout.n'"):
        load_config(["rollout.temperature=0.5"], config_file=f)
    with pytest.raises(ConfigError, match=r"override 'data.max_prompt_length=long': invalid value 'long'"):
        load_config(["data.max_prompt_length=long"], config_file=None)


def test_choices_name_valid_values():
    with pytest.raises(ConfigError, match=r"^override 'actor.lr_schedule=cosin': invalid value 'cosin' for "
                                          r"'actor.lr_schedule'; valid: constant, cosine; did you mean 'cosine'"):
        load_config(["actor.lr_schedule=cosin"])
    with pytest.raises(ConfigError, match=r"invalid value 'tensorbord' for 'trainer.loggers'.*tensorboard"):
        load_config(["trainer.loggers=[console,tensorbord]"])
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator'; valid: gae, grpo, rloo"):
        load_config(["algorithm.adv_estimator=ppo"])


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([], config_file=tmp_path / "missing.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config([], config_file=f)


def test_to_yaml_round_trip_and_diff(tmp_path):
    cfg = load_config(["rollout.n=8", "data.train_files=[a.parquet]", "actor.betas=[0.8,0.9]"])
    f = tmp_path / "saved.yaml"
    f.write_text(to_yaml(cfg))
    again = load_config([], config_file=f)
    assert again == cfg
    assert config_diff(cfg, again) == {}
    changed = load_config(["--config", str(f), "rollout.n=4", "actor.lr=2e-6"])
    assert config_diff(cfg, changed) == {"rollout.n": (8, 4), "actor.lr": (1e-6, 2e-6)}


@dataclass
class _TinySection:
    steps: int = opt(3, "steps")
    tags: list[str] = opt([], "tags", choices=("a", "b"))


@dataclass
class _TinySchema:
    run: _TinySection = opt(_TinySection, "the run")
    name: str = field(default="x", metadata={"help": "a name"})


def test_generic_schema():
    cfg = load_config(["run.steps=5", "run.tags=a"], schema=_TinySchema)
    assert isinstance(cfg, _TinySchema) and cfg.run.steps == 5 and cfg.run.tags == ["a"]
    with pytest.raises(ConfigError, match="did you mean 'run.steps'"):
        load_config(["run.step=5"], schema=_TinySchema)
