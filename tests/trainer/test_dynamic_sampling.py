"""DAPO's dynamic sampling end to end: more prompt batches are generated until `data.train_batch_size` groups
whose scores differ are kept, each step trains on exactly that many, the loader's position and a resumed
run stay exact, and running out of prompt batches stops with what to change (or trains on what was kept)."""

from __future__ import annotations

import pytest

from hybridflow.config.loader import load_config
from hybridflow.trainer import core
from hybridflow.trainer.rl import RLTrainer
from rl_helpers import VARIED, base_overrides, read_metrics, reward_file, run
from test_rl_resume_and_backends import assert_same_metrics

# Odd-numbered prompts always score 0 (their group teaches nothing and is dropped); even ones vary.
EVEN_VARY = f"0.0 if extra_info['index'] % 2 else {VARIED}"
COMMON = ("algorithm.filter_groups.enable=true", "trainer.val_before_train=false", "trainer.val_every=0",
          "algorithm.filter_groups.max_num_gen_batches=0")


def test_generates_until_the_batch_is_full_and_the_loader_counts_every_batch(tiny_qwen2, data_dir, tmp_path,
                                                                              monkeypatch, engine_steps):
    trained = []
    compute_advantages = core.compute_advantages
    monkeypatch.setattr(core, "compute_advantages", lambda batch, cfg: (trained.append(batch),
                                                                         compute_advantages(batch, cfg)))
    cfg = load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, *COMMON, "trainer.total_steps=3",
                                     f"reward.function={reward_file(tmp_path, EVEN_VARY)}"), "recipes/grpo.yaml")
    trainer = RLTrainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path)
    rounds = [r["filter_groups/num_gen_batches"] for r in rows]
    assert len(rounds) == 3 and max(rounds) > 1  # some step needed more than one prompt batch
    state = trainer.train_loader.state_dict()  # every prompt batch drawn is counted, none twice
    assert state["epoch"] * len(trainer.train_loader) + state["position"] == sum(rounds)
    for row, n in zip(rows, rounds):  # enough groups kept, less than one prompt batch of surplus
        assert 2 <= row["filter_groups/kept_ratio"] * n * 2 < 4
    assert [s["rows"] for s in engine_steps["lm"]] == [2 * 2] * 3  # exactly train_batch_size groups each step
    assert all(info["index"] % 2 == 0 for batch in trained for info in batch["extra_info"])  # varied groups only


def test_a_resumed_run_continues_identically(tiny_qwen2, data_dir, tmp_path):
    common = (*COMMON, f"reward.function={reward_file(tmp_path, EVEN_VARY)}")
    straight = run(tiny_qwen2, data_dir, tmp_path / "straight", *common, "trainer.total_steps=4")
    run(tiny_qwen2, data_dir, tmp_path / "resumed", *common, "trainer.total_steps=2")
    resumed = run(tiny_qwen2, data_dir, tmp_path / "resumed", *common, "trainer.total_steps=4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert any(r["filter_groups/num_gen_batches"] > 1 for r in straight[2:])
    for step in (3, 4):
        assert_same_metrics(straight[step - 1], resumed[step - 1])


def test_running_out_of_prompt_batches_says_what_to_change(tiny_qwen2, data_dir, tmp_path):
    with pytest.raises(RuntimeError) as err:
        run(tiny_qwen2, data_dir, tmp_path, *COMMON, "algorithm.filter_groups.max_num_gen_batches=3",
            f"reward.function={reward_file(tmp_path, '1.0')}")
    text = str(err.value)
    assert ("kept 0 of the data.train_batch_size=2 prompt groups it needs after 3 prompt batches "
            "(algorithm.filter_groups.max_num_gen_batches=3)") in text
    assert "algorithm.filter_groups.allow_partial_batch=true" in text


def test_partial_batches_train_on_the_groups_kept(tiny_qwen2, data_dir, tmp_path, engine_steps):
    # unshuffled, each prompt batch holds one even and one odd prompt: one group is kept per batch
    common = (*COMMON, "data.shuffle=false", f"reward.function={reward_file(tmp_path, EVEN_VARY)}")
    full = run(tiny_qwen2, data_dir, tmp_path / "full", *common, "algorithm.filter_groups.max_num_gen_batches=2")
    assert [r["filter_groups/num_gen_batches"] for r in full] == [2, 2]
    with pytest.raises(RuntimeError, match="kept 1 of the data.train_batch_size=2 prompt groups"):
        run(tiny_qwen2, data_dir, tmp_path / "short", *common, "algorithm.filter_groups.max_num_gen_batches=1")
    engine_steps.clear()
    partial = run(tiny_qwen2, data_dir, tmp_path / "partial", *common,
                  "algorithm.filter_groups.max_num_gen_batches=1", "algorithm.filter_groups.allow_partial_batch=true")
    assert [r["filter_groups/kept_ratio"] for r in partial] == [0.5, 0.5]
    assert [s["rows"] for s in engine_steps["lm"]] == [2, 2]  # one group of rollout.n=2 rows per step
