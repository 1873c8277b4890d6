"""Every recipe loads and validates; docs/config.md matches the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import load_config, validate
from hybridflow.config.config_docs import render_reference

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_required_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"grpo", "ppo", "dapo", "gspo", "rloo", "reinforce_pp"} <= names


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "sft"], ids=lambda p: p.stem)
def test_recipe_loads_and_validates(recipe):
    cfg = load_config([], config_file=recipe)
    for n_workers in (1, 2):
        validate(cfg, n_workers=n_workers, check_paths=False)


def test_the_sft_recipe_the_help_names_loads(capsys):
    from hybridflow.cli import main
    from hybridflow.config.sft_schema import SFTConfig

    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    assert "recipes/sft.yaml" in capsys.readouterr().out
    cfg = load_config(["model.path=m", "data.train_files=chats.jsonl"], ROOT / "recipes" / "sft.yaml", schema=SFTConfig)
    assert cfg.optim.lr == 1e-5 and cfg.trainer.output_dir == "outputs/sft"


def test_dapo_is_grpo_plus_its_changes():
    grpo = load_config([], config_file=ROOT / "recipes" / "grpo.yaml")
    dapo = load_config([], config_file=ROOT / "recipes" / "dapo.yaml")
    assert dapo.rollout.n == grpo.rollout.n and dapo.algorithm.adv_estimator == "grpo"
    assert dapo.actor.clip_high > dapo.actor.clip_low and dapo.actor.kl_loss_coef == 0.0
    assert dapo.algorithm.overlong_buffer.enable and dapo.algorithm.filter_groups.enable


def test_gspo_is_grpo_with_the_papers_clip_bounds():
    gspo = load_config([], config_file=ROOT / "recipes" / "gspo.yaml")
    assert gspo.actor.policy_loss == "gspo" and gspo.algorithm.adv_estimator == "grpo"
    assert (gspo.actor.clip_low, gspo.actor.clip_high) == (3e-4, 4e-4)


def test_ppo_recipe_has_a_critic():
    cfg = load_config([], config_file=ROOT / "recipes" / "ppo.yaml")
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.lr > cfg.actor.lr


def test_config_reference_is_fresh():
    doc = ROOT / "docs" / "config.md"
    assert doc.read_text() == render_reference(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_reference_lists_every_key_with_help():
    text = render_reference()
    for key in ("rollout.temperature", "actor.loss_agg", "algorithm.kl_ctrl.target_kl", "trainer.resume"):
        assert f"| `{key}` |" in text
    assert "one of `constant`, `cosine`" in text
