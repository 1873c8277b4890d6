"""A verl user's config mistakes are named at once (issue 36, items 4 and 6): every unknown key together, verl's
keys answered with ours from the one table `hybridflow migrate` uses, Hydra's `+key=value`, and code files a
recipe names found next to the recipe."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import schema_fields
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.validate import ConfigError
from hybridflow.config.verl_keys import VERL_KEYS, render_verl_table
from hybridflow.config.verl_sft_keys import VERL_SFT_KEYS

ROOT = Path(__file__).resolve().parents[2]


def test_every_unknown_key_is_reported_at_once_with_verls_names_answered():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.test_freq=5", "rollout.temprature=0.5",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], ROOT / "recipes" / "grpo.yaml")
    text = str(err.value)
    assert text.startswith("4 problems in the configuration:")
    assert "unknown key 'actor_rollout_ref.actor.optim.lr': verl's key; in hybridflow it is 'actor.lr'" in text
    assert "unknown key 'trainer.test_freq': verl's key; in hybridflow it is 'trainer.val_every'" in text
    assert "unknown key 'rollout.temprature'; did you mean 'rollout.temperature'?" in text
    assert "'actor_rollout_ref.rollout.tensor_model_parallel_size': verl's key; hybridflow has no equivalent: each " \
           "device runs a data-parallel rollout replica" in text


def test_a_verl_yaml_section_names_each_of_its_keys(tmp_path):
    recipe = tmp_path / "verl_like.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n  rollout:\n    n: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config([], recipe)
    assert "'actor_rollout_ref.actor.ppo_mini_batch_size': verl's key; in hybridflow it is 'actor.mini_batch_size'" \
           in str(err.value) and "'actor_rollout_ref.rollout.n': verl's key; in hybridflow it is 'rollout.n'" in str(err.value)


def test_hydra_plus_keys_are_plain_overrides():
    cfg = load_config(["+reward.kwargs.method=flexible", "++rollout.n=4"])
    assert cfg.reward.kwargs == {"method": "flexible"} and cfg.rollout.n == 4


def test_the_verl_tables_name_only_keys_we_have_and_the_docs_show_them():
    docs = (ROOT / "docs" / "migrating_from_verl.md").read_text()
    for keys, schema in ((VERL_KEYS, RLConfig), (VERL_SFT_KEYS, SFTConfig)):
        ours = set(schema_fields(schema))
        for verl, entry in keys.items():
            assert entry.ours is None or entry.ours in ours, (verl, entry.ours)
        assert render_verl_table(keys) in docs


def test_code_files_a_recipe_names_are_found_next_to_it(tmp_path, monkeypatch):
    folder = tmp_path / "my_recipes"
    (folder / "envs").mkdir(parents=True)
    (folder / "envs" / "game.py").write_text("class Game:\n    def step(self, text, turn):\n        return None\n")
    (folder / "score.py").write_text(textwrap.dedent("""
        def score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """))
    (folder / "run.yaml").write_text(f"base: {ROOT / 'recipes' / 'grpo.yaml'}\nagent:\n  environment: envs/game.py:Game\n"
                                     "reward:\n  function: score.py:score\n")
    monkeypatch.chdir(tmp_path)  # not the recipe's folder
    cfg = load_config([], folder / "run.yaml")
    assert cfg.agent.environment == f"{folder / 'envs' / 'game.py'}:Game"
    assert cfg.reward.function == f"{folder / 'score.py'}:score"
    monkeypatch.chdir("/")  # the repository's own recipe, run from elsewhere
    env = load_config([], ROOT / "recipes" / "multiturn_retry.yaml").agent.environment
    assert env == f"{ROOT / 'recipes' / 'environments' / 'feedback_retry.py'}:FeedbackRetry"
