"""`rollout.placement=separate`: the same GRPO run as the colocated one (same seed, same metrics), and
the combinations it cannot run refused with the keys and valid values named."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.resolved import resolve_facts
from hybridflow.trainer.role_groups import build_roles
from rl_helpers import run
from test_rl_resume_and_backends import assert_same_metrics


def test_separate_rollout_gives_the_colocated_metrics(tiny_qwen2, data_dir, tmp_path):
    # lr 0.1: large enough that step 3's samples, hence its metrics, differ if a sync delivers stale weights
    common = ("trainer.val_before_train=false", "trainer.total_steps=3", "trainer.val_every=3", "actor.lr=0.1")
    colocated = run(tiny_qwen2, data_dir, tmp_path / "colocate", *common)
    separate = run(tiny_qwen2, data_dir, tmp_path / "separate", *common, "rollout.placement=separate")
    assert [r["step"] for r in separate] == [1, 2, 3]
    for a, b in zip(colocated, separate):
        assert_same_metrics(a, b)
    assert all(r["timing_s/update_weights"] > 0 for r in separate)
    assert "val/reward/mean" in separate[-1]


def _problems(*overrides) -> str:
    cfg = load_config(["rollout.n=2", "data.train_batch_size=6", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_paths=False)
    return str(e.value)


def test_bad_rollout_placements_are_refused():
    assert ("rollout.n_workers=2 sizes the separate rollout group, but rollout.placement=colocate runs the "
            "engine in the actor's trainer.n_workers processes; set rollout.placement=separate (unset, it follows) or "
            "rollout.n_workers=null") in _problems("rollout.n_workers=2", "rollout.placement=colocate")
    assert ("data.train_batch_size=6 prompts must split evenly over the 4 rollout ranks (rollout.n_workers=4, "
            "null = trainer.n_workers); valid rollout.n_workers: 1, 2, 3, 6"
            ) in _problems("rollout.placement=separate", "rollout.n_workers=4")
    assert "rollout.n_workers=0 must be >= 1" in _problems("rollout.placement=separate", "rollout.n_workers=0")
    with pytest.raises(ConfigError, match="invalid value 'apart' for 'rollout.placement'; valid: colocate, separate"):
        load_config(["rollout.placement=apart"])


def test_separate_rollout_without_enough_gpus_is_refused_before_any_group_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config(["trainer.device=cuda", "trainer.n_workers=2", "rollout.placement=separate"])
    with pytest.raises(ValueError) as e:
        build_roles(cfg, total_steps=1, facts=resolve_facts(cfg))
    assert ("this run needs 4 GPUs (2 for actor, 2 for rollout (rollout.placement=separate)) but this machine "
            "has 2 (torch.cuda.device_count()); lower trainer.n_workers / rollout.n_workers, or use "
            "rollout.placement=colocate / trainer.placement=colocate") in str(e.value)
