"""DAPO's dynamic sampling end to end: more prompt batches are generated until `data.train_batch_size` groups
whose scores differ are kept, each step trains on exactly that many, the loader's position and a resumed
run stay exact, and running out of prompt batches stops with what to change (or trains on what was kept)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.trainer import step_math
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
    compute_advantages = step_math.compute_advantages
    monkeypatch.setattr(step_math, "compute_advantages", lambda batch, cfg, facts: (
        trained.append(batch), compute_advantages(batch, cfg, facts))[1])
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
    with pytest.raises(RuntimeError, match="kept 0 of") as err:  # nothing kept: nothing to train on
        run(tiny_qwen2, data_dir, tmp_path / "partial", *COMMON, "algorithm.filter_groups.max_num_gen_batches=1",
            "algorithm.filter_groups.allow_partial_batch=true", f"reward.function={reward_file(tmp_path, '1.0')}")
    assert "allow_partial_batch" not in str(err.value)


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


def test_rounds_with_different_prompt_widths_concatenate_left_padded():
    from hybridflow.batch import Batch

    def rows(prompt: list[list[int]], response: list[int]) -> Batch:
        prompts = torch.tensor(prompt)
        mask = torch.cat([(prompts != 0).long(), torch.ones(len(prompt), len(response), dtype=torch.long)], 1)
        return Batch({"prompts": prompts, "input_ids": torch.cat([prompts, torch.tensor([response] * len(prompt))], 1),
                      "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                      "responses": torch.tensor([response] * len(prompt))}, {"uid": [str(p) for p in prompt]})

    merged = step_math.concat_rounds([rows([[5, 6]], [9]), rows([[0, 7, 8, 4]], [3])], pad_id=0)
    assert merged["prompts"].tolist() == [[0, 0, 5, 6], [0, 7, 8, 4]]
    assert merged["input_ids"].tolist() == [[0, 0, 5, 6, 9], [0, 7, 8, 4, 3]]
    assert merged["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert merged["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 0, 1, 2, 3]]
    assert merged["responses"].tolist() == [[9], [3]] and list(merged["uid"]) == ["[5, 6]", "[0, 7, 8, 4]"]


def test_round_metrics_average_means_and_add_counts():
    merged = step_math.merge_round_metrics([{"reward/mean": 0.2, "reward/errors": 1.0, "reward/acc/mean": 1.0},
                                       {"reward/mean": 0.4, "reward/errors": 2.0, "reward/acc/mean": 0.0}])
    assert merged == pytest.approx({"reward/mean": 0.3, "reward/errors": 3.0, "reward/acc/mean": 0.5})
