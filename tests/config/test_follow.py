"""Defaults that follow the key that turns a feature on (`hybridflow.config.follow`), seen from the command line:
`hybridflow config` with the one key prints the followed value and why, and its output loads again; a key set
to another value is kept and refused by the checks, naming both keys. Also `~key`, which replaces a recipe's
mapping instead of merging into it."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.cli import main as cli_main
from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.sft_schema import SFTConfig

# (the key turning a feature on, the key that follows, its followed value, a part of the reason printed)
CASES = [
    ("rollout.partial=true", "rollout.free_cache_after_generate", False,
     "rollout.partial=true with rollout.partial_unfinished=continue keeps unfinished samples' KV slots"),
    ("agent.runner=agent.py:play", "reward.function", "environment", "agent.runner returns each trajectory's reward"),
    ("agent.verifiers=vf-gsm8k", "reward.function", "environment", "agent.verifiers returns"),
    ("agent.gym=textarena:GuessTheNumber-v0", "reward.function", "environment", "agent.gym returns"),
    ("agent.openenv=openenv.core:GenericEnvClient", "reward.function", "environment", "agent.openenv returns"),
    ("actor.router_replay=rollout", "rollout.record_routes", True, "replays the experts the rollout engine recorded"),
    ("algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward", True, "controls the in-reward KL"),
    ("rollout.pipeline=true", "rollout.placement", "separate", "on the rollout's own devices"),
    ("rollout.n_workers=2", "rollout.placement", "separate", "rollout.n_workers=2 sizes the separate rollout group"),
    ("model.master_dtype=bf16", "actor.optimizer", "adamw_8bit", "stochastic rounding"),
    ("ray.address=auto", "trainer.backend", "ray", "ray.address=auto place worker groups on a Ray cluster"),
    ("ray.rollout.strategy=pack", "rollout.placement", "separate", "ray.rollout.strategy=pack place the separate"),
]
# the same keys set to a value the feature cannot run with: kept, and refused with both keys named
CONTRARY = [
    ("rollout.partial=true", "rollout.free_cache_after_generate=true", "set rollout.free_cache_after_generate=false"),
    ("agent.runner=agent.py:play", "reward.function=gsm8k", None),  # a function of the user's: kept, and valid
    ("actor.router_replay=rollout", "rollout.record_routes=false", "set rollout.record_routes=true"),
    ("algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=false", "set algorithm.use_kl_in_reward=true"),
    ("rollout.pipeline=true", "rollout.placement=colocate", "set rollout.placement=separate"),
    ("rollout.n_workers=2", "rollout.placement=colocate", "set rollout.placement=separate"),
    ("model.master_dtype=bf16", "actor.optimizer=adamw", "model.master_dtype=bf16 needs actor.optimizer=adamw_8bit"),
    ("ray.address=auto", "trainer.backend=local", "set trainer.backend=ray"),
    ("ray.rollout.strategy=pack", "rollout.placement=colocate", "set rollout.placement=separate"),
]


def value_of(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def printed(capsys, *args) -> str:
    assert cli_main(["config", "--no-checks", *args]) == 0  # a partial config: no model or data
    return capsys.readouterr().out


@pytest.mark.parametrize("feature,key,value,why", CASES, ids=[c[0] for c in CASES])
def test_the_one_key_turning_a_feature_on_is_enough(feature, key, value, why, capsys, tmp_path):
    out = printed(capsys, feature)
    shown = str(value).lower() if isinstance(value, bool) else value
    (line,) = [line for line in out.splitlines() if line.startswith(f"#   {key}=")]
    assert line.startswith(f"#   {key}={shown}: ") and why in line
    (tmp_path / "printed.yaml").write_text(out)  # the printed config loads again, the followed value in it
    cfg = load_config(config_file=tmp_path / "printed.yaml")
    assert value_of(cfg, key) == value and cfg == load_config([feature])
    validate(load_config([feature, "data.train_batch_size=2", "rollout.n=2"]), check_paths=False)


def test_nothing_follows_without_the_feature(capsys):
    assert "#" not in printed(capsys)
    cfg = load_config([])
    assert cfg.rollout.free_cache_after_generate and cfg.reward.function == "auto" and not cfg.rollout.record_routes


@pytest.mark.parametrize("feature,setting,refusal", CONTRARY, ids=[c[1] for c in CONTRARY])
def test_a_key_set_otherwise_is_kept_and_refused_with_both_keys_named(feature, setting, refusal):
    key, _, value = setting.partition("=")
    cfg = load_config([feature, setting, "data.train_batch_size=2", "rollout.n=2"])
    assert str(value_of(cfg, key)).lower() == value
    if refusal is None:
        validate(cfg, check_paths=False)
        return
    with pytest.raises(ConfigError, match=refusal) as err:
        validate(cfg, check_paths=False)
    assert feature.split("=")[0] in str(err.value) and "unset, it follows" in str(err.value)


def test_a_recipe_sets_a_key_as_an_override_does(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  free_cache_after_generate: true\n")
    assert load_config(["rollout.partial=true"], recipe).rollout.free_cache_after_generate is True
    # reward.function=auto (recipes/grpo.yaml writes it) asks for the choice: an endpoint way's reward is it
    assert load_config(["agent.runner=agent.py:play"], "recipes/grpo.yaml").reward.function == "environment"
    # with several reward functions, reward.function is unused: nothing follows
    cfg = load_config(["agent.runner=agent.py:play", "reward.functions=[gsm8k]"])
    assert cfg.reward.function == "auto"


def test_the_sft_and_preference_programs_follow_their_own_keys():
    assert load_config(["model.master_dtype=bf16"], schema=SFTConfig).optim.optimizer == "adamw_8bit"
    assert load_config(["model.master_dtype=bf16", "optim.optimizer=adamw"], schema=SFTConfig).optim.optimizer == "adamw"


def test_tilde_replaces_a_recipes_mapping_instead_of_merging(capsys):
    recipe = ("--config", "recipes/multiturn_retry.yaml")
    merged = yaml.safe_load(printed(capsys, *recipe, "agent.env_kwargs={}"))
    assert merged["agent"]["env_kwargs"] == {"decay": 0.5}
    replaced = yaml.safe_load(printed(capsys, *recipe, "~agent.env_kwargs", "agent.env_kwargs={start: 2}"))
    assert replaced["agent"]["env_kwargs"] == {"start": 2}
    emptied = yaml.safe_load(printed(capsys, *recipe, "~agent.env_kwargs"))
    assert emptied["agent"]["env_kwargs"] == {}
    # a section too: back to its defaults; later overrides set anew, earlier ones are forgotten
    reset = yaml.safe_load(printed(capsys, *recipe, "agent.max_turns=9", "~agent", "agent.timeout_s=3"))
    assert reset["agent"]["environment"] is None and reset["agent"]["max_turns"] == 4
    assert reset["agent"]["timeout_s"] == 3


@pytest.mark.parametrize("item,message", [
    ("~agent.env_kwarg", "override '~agent.env_kwarg': unknown key 'agent.env_kwarg'; did you mean 'agent.env_kwargs'?"),
    ("~agent.env_kwargs={}", "~ takes a key alone"),
    ("~", "~ takes a key alone"),
])
def test_tilde_names_what_is_wrong(item, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        load_config([item])
