"""Every option the config, the recipes and the README advertise trains end to end: `hybridflow train` for 2
steps on the tiny model, with a reward that differs between the responses to one prompt, for every
registered advantage estimator, policy loss and rollout correction, every loss aggregation, each KL
estimator in the reward and as a loss, adaptive KL, the critic (and its warm-up), DAPO's overlong penalty
and group filter, Dr.GRPO, the entropy bonus, several PPO epochs and mini-batches, LoRA on the actor and the
critic with each of its keys, and every file under `recipes/` (shrunk). Each run must take optimizer steps with
finite, non-zero gradient norms that change the weights (never a frozen one), for the actor and (when there is
one) the critic.

The cases are read from the registries, so an estimator or loss registered later is swept too: one that
cannot run fails here. All cases share one tiny model and one data file, and run in this process (a
one-worker group runs inline; `reward.num_workers=0` scores in the controller)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridflow.algorithms import ADV_ESTIMATORS, AGG_MODES, KL_KINDS, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from hybridflow.cli import main as cli_main
from hybridflow.config.loader import load_config
from hybridflow.config.role_needs import needs_critic
from rl_helpers import read_metrics, reward_file

ROOT = Path(__file__).resolve().parents[2]
# sft.yaml trains in test_sft.py; geo3k_vl.yaml needs a vision-language model and image rows: test_vision_train.py
ELSEWHERE = {"sft", "geo3k_vl"}
RECIPES = sorted(r for r in (ROOT / "recipes").glob("*.yaml") if r.stem not in ELSEWHERE)

# Settings an option or a recipe cannot run without (beyond the small run below); a new entry that needs some
# adds them here. The calculator recipe's prompts carry the tool descriptions (~700 tokens of the tiny
# byte-level tokenizer).
NEEDS = {"actor.policy_loss=gspo": ("actor.clip_low=3e-4", "actor.clip_high=4e-4"),
         "recipe=gsm8k_calculator": ("data.max_prompt_length=1024",)}

SMALL = ("data.train_batch_size=2", "rollout.n=2", "data.max_prompt_length=256", "data.max_response_length=8",
         "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.val_every=0", "trainer.loggers=[jsonl]",
         "reward.num_workers=0")
# A recipe keeps its algorithm; its batch sizes shrink (a mini-batch of 1 prompt: two optimizer steps a step).
SHRINK = (*SMALL, "actor.mini_batch_size=1", "critic.mini_batch_size=1", "algorithm.overlong_buffer.len=4")


def option_cases() -> list[tuple[str, tuple[str, ...], str | None]]:
    """(id, overrides, recipe) of every case; the options equal to their defaults run once, together."""
    options = [f"algorithm.adv_estimator={name}" for name in ADV_ESTIMATORS]
    options += [f"actor.policy_loss={name}" for name in POLICY_LOSSES]
    options += [f"actor.loss_agg={mode}" for mode in AGG_MODES]
    options += [f"actor.rollout_correction.mode={mode}" for mode in ROLLOUT_CORRECTIONS]
    defaults = load_config([])
    default = [o for o in options if value_of(defaults, o.split("=")[0]) == o.split("=")[1]]
    cases = {(): ",".join(default)}  # the defaults' run covers every option equal to its default
    cases.update({(o, *NEEDS.get(o, ())): o for o in options if o not in default})
    for i, kind in enumerate(KL_KINDS):  # each estimator once in the reward and once as a loss
        loss_kind = KL_KINDS[(i + 1) % len(KL_KINDS)]
        cases[("algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={kind}", "actor.kl_loss_coef=0.1",
               f"actor.kl_loss_type={loss_kind}")] = f"kl_in_reward={kind},kl_loss={loss_kind}"
    cases[("algorithm.kl_ctrl.type=adaptive",)] = "adaptive_kl"  # algorithm.use_kl_in_reward follows: true
    cases[("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4")] = "overlong_buffer"
    cases[("algorithm.filter_groups.enable=true",)] = "filter_groups"
    cases[("algorithm.adv_estimator=remax", "algorithm.filter_groups.enable=true")] = "remax+filter_groups"
    cases[("actor.ppo_epochs=2", "actor.mini_batch_size=1")] = "ppo_epochs=2,mini_batches=2"
    cases[("algorithm.norm_adv_by_std=false", "actor.loss_agg=seq-mean-token-sum-norm")] = "dr_grpo"
    cases[("actor.entropy_coef=0.01",)] = "entropy_bonus"
    cases[("algorithm.adv_estimator=gae", "critic.warmup_steps=1")] = "critic_warmup"
    cases[("actor.lora.rank=4", "actor.lora.alpha=8", "actor.kl_loss_coef=0.1")] = "lora+kl_loss"
    cases[("actor.lora.rank=2", "actor.lora.dropout=0.1", "actor.lora.init=gaussian",
           "actor.lora.target_modules=[o_proj,mlp.down_proj]", "algorithm.adv_estimator=gae", "critic.lora.rank=4",
           "critic.lora.alpha=4", "critic.lora.dropout=0.1", "critic.lora.init=gaussian",
           "critic.lora.target_modules=[q_proj,v_proj]")] = "lora_keys,critic_lora"
    out = [(case_id, overrides, None) for overrides, case_id in cases.items()]
    return out + [(f"recipe={recipe.stem}", (*SHRINK, *NEEDS.get(f"recipe={recipe.stem}", ())), str(recipe))
                  for recipe in RECIPES]


def value_of(cfg, key: str) -> str:
    """The value of dotted `key` in `cfg`, as an override would write it."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return str(cfg)


CASES = option_cases()


@pytest.mark.parametrize("overrides, recipe", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_option_trains(tiny_qwen2, data_dir, tmp_path, engine_steps, overrides, recipe):
    args = [f"model.path={tiny_qwen2}", f"data.train_files={data_dir}/train.parquet", *SMALL, *overrides,
            f"reward.function={reward_file(tmp_path)}", f"trainer.output_dir={tmp_path / 'out'}"]
    assert cli_main(["train", *(["--config", recipe] if recipe else []), *args]) == 0
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(v) for k, v in row.items() if isinstance(v, float) and not k.startswith("val/")), row
    roles = {"lm": "actor", "value": "critic"}
    cfg = load_config(args, recipe)
    expected = {"lm", "value"} if needs_critic(cfg) else {"lm"}
    assert set(engine_steps) == expected
    for head, steps in engine_steps.items():
        lora = getattr(cfg, roles[head]).lora.rank > 0  # LoRA trains the adapters (and a value head) alone
        for step in steps:
            assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0, (roles[head], steps)
            assert step["changed"] and not step["frozen_changed"], (roles[head], steps)
            assert (step["trained_share"] < 0.5) == lora, (roles[head], steps)
    check_option(overrides, rows, engine_steps)


def check_option(overrides: tuple[str, ...], rows: list[dict], engine_steps: dict) -> None:
    """What the options with a visible effect of their own must show."""
    if "algorithm.kl_ctrl.type=adaptive" in overrides:  # the coefficient moves towards the target KL
        assert rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]
    if "algorithm.overlong_buffer.enable=true" in overrides:
        assert rows[-1]["reward/overlong_penalty/mean"] <= 0
    if "algorithm.filter_groups.enable=true" in overrides:
        assert all(r["filter_groups/num_gen_batches"] >= 1 for r in rows)
    if "algorithm.adv_estimator=remax" in overrides:
        assert all(math.isfinite(r["reward/baseline/mean"]) for r in rows)
    if "actor.ppo_epochs=2" in overrides:  # 2 epochs x 2 mini-batches x 2 steps
        assert len(engine_steps["lm"]) == 8
    if any(o.startswith("actor.kl_loss_coef=") for o in overrides):
        assert all(math.isfinite(r["actor/kl_loss"]) for r in rows)
    if "critic.warmup_steps=1" in overrides:  # the actor waits out the critic's first step
        assert len(engine_steps["lm"]) == 1 and len(engine_steps["value"]) == 2
