"""End-to-end `hybridflow train` runs on a tiny random model and a tiny verl-format parquet."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from hybridflow.cli import main as cli_main
from hybridflow.config.loader import load_config
from hybridflow.data.files import DataError
from hybridflow.trainer.rl import train
from rl_helpers import reward_file, run

REQUIRED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "timing_s/gen",
            "timing_s/step", "perf/throughput")


def test_grpo_end_to_end_writes_standard_metrics(tiny_qwen2, data_dir, tmp_path):
    rows = run(tiny_qwen2, data_dir, tmp_path, "trainer.loggers=[console,jsonl,tensorboard]")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        for key in REQUIRED:
            assert key in row and math.isfinite(row[key]), key
        assert "actor/entropy" in row
        assert "timing_s/old_log_prob" not in row  # on-policy: the update's own log-probs are the old ones
    assert "val/reward/mean" in rows[0] and rows[0]["step"] == 0  # validation before training
    assert "val/reward/mean" in steps[-1]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize("arch,engine", [("olmo2", "fast"), ("phi3", "fast"), ("gemma3_text", "fast"),
                                         ("qwen3_5_text", "fast"), ("qwen3_5", "fast"), ("qwen3_next", "fast"),
                                         ("gpt2", "hf")])
def test_a_family_trains_on_its_rollout_path(arch, engine, tiny_model_factory, data_dir, tmp_path):
    """OLMo 2, Phi-3, Gemma 3 (its prompts longer than its 8-token sliding window), Qwen3.5 and Qwen3-Next (hybrid
    linear attention: their packed rows restart the states at each sequence; `qwen3_5`: a checkpoint as published,
    its language model trained alone; Qwen3-Next's MLPs mixtures of experts) generate on the fast path; GPT-2 has
    none, so its generation runs through transformers.generate (which says so, with its rate:
    tests/engine/rollout/test_rollout_parts.py) and the step trains the same."""
    import yaml

    forced = ["rollout.engine=fast"] if engine == "fast" else []  # the fallback's family keeps auto, which falls back
    rows = run(tiny_model_factory(arch), data_dir, tmp_path, "trainer.val_before_train=false",
               "trainer.total_steps=1", "trainer.val_every=0", f"reward.function={reward_file(tmp_path)}", *forced)
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["actor/pg_loss"])
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["response_length/mean"] > 0
    resolved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert resolved["rollout"]["engine"] == engine


def test_ppo_with_critic_trains_both(tiny_qwen2, data_dir, tmp_path):
    rows = run(tiny_qwen2, data_dir, tmp_path, "trainer.val_before_train=false", recipe="recipes/ppo.yaml")
    last = rows[-1]
    assert last["step"] == 2
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "values/mean", "timing_s/old_log_prob",
                "actor/entropy"):
        assert key in last and math.isfinite(last[key]), key
    # what the workers filled in where the config left it open, beside metrics.jsonl, loadable again
    resolved = load_config([], tmp_path / "resolved_config.yaml")
    asked = load_config([], "recipes/ppo.yaml")
    assert asked.model.gradient_checkpointing is None and resolved.model.gradient_checkpointing is False
    assert resolved.critic.model.gradient_checkpointing is False and resolved.critic.model.compile is False
    assert asked.model.dtype == "auto" and resolved.model.dtype == resolved.critic.model.dtype == "fp32"
    assert resolved.rollout.engine == "fast" and resolved.rollout.max_num_seqs == 4  # a CPU holds a step's rows
    assert resolved.actor.lr == 1e-4 and resolved.data.train_batch_size == 2  # the run's own values stay


def test_custom_reward_file_and_extras_are_logged(tiny_qwen2, data_dir, tmp_path):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def char_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    code = sum(map(ord, solution_str)) % 7\n"
                  "    return {'score': code / 7.0, 'code': code}\n")
    rows = run(tiny_qwen2, data_dir, tmp_path / "out", f"reward.function={fn}:char_reward",
               "trainer.val_before_train=false", "trainer.total_steps=1")
    assert "reward/code/mean" in rows[-1]
    assert rows[-1]["reward/mean"] == pytest.approx(rows[-1]["reward/code/mean"] / 7.0, rel=1e-5)
    assert rows[-1]["actor/grad_norm"] > 0  # rewards differ within groups, so the policy moves


def test_raising_reward_uses_fallback_and_run_continues(tiny_qwen2, data_dir, tmp_path):
    fn = tmp_path / "bad_reward.py"
    fn.write_text("def broken(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    raise RuntimeError('boom')\n")
    rows = run(tiny_qwen2, data_dir, tmp_path / "out", f"reward.function={fn}:broken", "reward.fallback_score=-1",
               "trainer.val_before_train=false", "trainer.total_steps=1")
    assert rows[-1]["reward/errors"] == 4  # 2 prompts x 2 samples, all failed
    assert rows[-1]["reward/mean"] == -1.0


def test_malformed_dataset_is_refused_before_any_model_loads(tiny_qwen2, data_dir, tmp_path):
    bad = tmp_path / "bad.parquet"
    table = pq.read_table(f"{data_dir}/train.parquet")
    pq.write_table(table.drop_columns(["prompt"]), bad)
    with pytest.raises(DataError, match=r"bad\.parquet.*prompt"):
        train(load_config([f"model.path={tiny_qwen2}", f"data.train_files={bad}",
                           f"trainer.output_dir={tmp_path / 'out'}"], "recipes/grpo.yaml"))


def test_bad_key_fails_with_did_you_mean(capsys):
    assert cli_main(["train", "--config", "recipes/grpo.yaml", "rollout.temprature=0.5"]) == 2
    assert "did you mean 'rollout.temperature'" in capsys.readouterr().err


def test_reward_model_scores_are_added_to_the_function_reward(tiny_qwen2, data_dir, tmp_path, trained_reward_model):
    """The reward model is the one `hybridflow rm` trained (the `trained_reward_model` fixture)."""
    rows = run(tiny_qwen2, data_dir, tmp_path / "out", f"reward.reward_model.path={trained_reward_model / 'hf'}",
               "reward.reward_model.weight=0.5", "trainer.val_before_train=false", "trainer.total_steps=1")
    last = rows[-1]
    assert math.isfinite(last["reward/model/mean"]) and last["reward/model/mean"] != 0
    # gsm8k scores of a random model are 0, so the step's reward is the weighted reward-model score
    assert last["reward/mean"] == pytest.approx(0.5 * last["reward/model/mean"], rel=1e-4, abs=1e-6)


def test_output_dir_without_room_for_a_checkpoint_is_refused_before_training(tiny_qwen2, data_dir, tmp_path,
                                                                             monkeypatch):
    from hybridflow.checkpoint import CheckpointError
    from hybridflow.trainer import rl

    monkeypatch.setattr(rl, "checkpoint_bytes_needed", lambda cfg: 2**62)
    with pytest.raises(CheckpointError, match="free"):
        run(tiny_qwen2, data_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
