"""What every trainer shares (`hybridflow.trainer.base`): each lr schedule spans exactly the optimizer steps
the run takes, the parts every trainer builds, and checkpoint saves that fail without leaving debris."""

from __future__ import annotations

import pytest
from rl_helpers import base_overrides

from hybridflow.checkpoint import CheckpointError
from hybridflow.config.loader import load_config
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.controller import WorkerError
from hybridflow.trainer.rl import RLTrainer
from hybridflow.trainer.role_groups import role_optimizer_steps
from hybridflow.trainer.sft_trainer import SFTTrainer


def assert_warmup_then_cosine(lrs: list[float], lr: float, warmup: int, floor: float, steps: int) -> None:
    """Linear warm-up that reaches `lr` at the `warmup`-th optimizer step, then a cosine strictly falling to
    `floor` x lr, reached at the last of `steps` optimizer steps and not before."""
    assert len(lrs) == steps
    assert lrs[:warmup] == pytest.approx([lr * (k + 1) / warmup for k in range(warmup)], rel=1e-6)
    decay = lrs[warmup - 1:]
    assert all(a > b for a, b in zip(decay, decay[1:])), lrs
    assert decay[-2] > floor * lr * (1 + 1e-3) and decay[-1] == pytest.approx(floor * lr, rel=1e-6), lrs


def test_rl_lr_schedules_span_every_optimizer_step(tiny_qwen2, data_dir, tmp_path, engine_steps):
    # gae trains a critic; critic.warmup_steps=1 leaves the actor 1 of the 2 trainer steps.
    # actor: 1 step x 2 PPO epochs x 2 mini-batches (of 1 prompt out of 2) = 4 optimizer steps;
    # critic: 2 steps x 2 epochs x 2 mini-batches = 8.
    cfg = load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, "algorithm.adv_estimator=gae",
                                     "critic.warmup_steps=1", "actor.ppo_epochs=2", "critic.ppo_epochs=2",
                                     "actor.mini_batch_size=1", "critic.mini_batch_size=1",
                                     "actor.lr_schedule=cosine", "actor.lr_warmup_steps=2", "actor.min_lr_ratio=0.1",
                                     "critic.lr=1e-3", "critic.lr_schedule=cosine", "critic.lr_warmup_steps=3",
                                     "critic.min_lr_ratio=0", "trainer.val_every=0",
                                     "trainer.val_before_train=false"), "recipes/grpo.yaml")
    RLTrainer(cfg).fit()
    assert_warmup_then_cosine([s["lr"] for s in engine_steps["lm"]], 1e-4, warmup=2, floor=0.1, steps=4)
    assert_warmup_then_cosine([s["lr"] for s in engine_steps["value"]], 1e-3, warmup=3, floor=0.0, steps=8)
    assert engine_steps["lm"][-1]["position"] == 4 and engine_steps["value"][-1]["position"] == 8


def test_sft_lr_schedule_spans_every_optimizer_step(tiny_qwen2, chats, tmp_path, engine_steps):
    # 2 trainer steps x 2 passes x 2 mini-batches (of 2 conversations out of 4) = 8 optimizer steps
    cfg = load_config([f"model.path={tiny_qwen2}", f"data.train_files={chats}", "data.train_batch_size=4",
                       "optim.mini_batch_size=2", "optim.passes_per_batch=2", "optim.lr=1e-3",
                       "optim.lr_schedule=cosine", "optim.lr_warmup_steps=1", "optim.min_lr_ratio=0.2",
                       "trainer.total_steps=2", f"trainer.output_dir={tmp_path}"], schema=SFTConfig)
    SFTTrainer(cfg).fit()
    assert_warmup_then_cosine([s["lr"] for s in engine_steps["lm"]], 1e-3, warmup=1, floor=0.2, steps=8)
    assert engine_steps["lm"][-1]["position"] == 8
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "hf" / "config.json").is_file()


def test_role_optimizer_steps_count_epochs_mini_batches_and_the_critic_warmup():
    cfg = load_config(["algorithm.adv_estimator=gae", "data.train_batch_size=8", "actor.mini_batch_size=2",
                       "actor.ppo_epochs=3", "critic.mini_batch_size=4", "critic.warmup_steps=2"])
    assert role_optimizer_steps(cfg, "actor", 10) == (10 - 2) * 3 * 4  # no actor update in the critic's warmup
    assert role_optimizer_steps(cfg, "critic", 10) == 10 * 1 * 2
    grpo = load_config(["data.train_batch_size=8", "critic.warmup_steps=2"])
    assert role_optimizer_steps(grpo, "actor", 10) == 10  # no critic, no warmup; null mini-batch = one step


def test_sft_validation_loss_is_the_same_on_one_and_two_ranks(tiny_qwen2, chats, tmp_path):
    losses = []
    for n in (1, 2):
        cfg = load_config([f"model.path={tiny_qwen2}", f"data.train_files={chats}", f"data.val_files={chats}",
                           "data.train_batch_size=4", "data.val_batch_size=5", f"trainer.n_workers={n}",
                           f"trainer.output_dir={tmp_path / str(n)}"], schema=SFTConfig)
        trainer = SFTTrainer(cfg)
        try:
            assert trainer.n_devices == n and trainer.checkpointed_roles() == {"sft": trainer.workers}
            losses.append(trainer.validate()["val/loss"])  # eval_nll sums over the ranks (collect="same")
        finally:
            trainer.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_failed_checkpoint_save_leaves_no_temp_dir(tiny_qwen2, chats, tmp_path, monkeypatch):
    from hybridflow.workers.sft_worker import SFTWorker

    cfg = load_config([f"model.path={tiny_qwen2}", f"data.train_files={chats}", "data.train_batch_size=4",
                       "trainer.total_steps=1", f"trainer.output_dir={tmp_path}"], schema=SFTConfig)
    trainer = SFTTrainer(cfg)

    def disk_full(self, role_dir: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SFTWorker, "save_checkpoint", disk_full)  # the inline worker runs in this process
    try:
        trainer.step = 1
        with pytest.raises(CheckpointError, match=r"cannot save step 1: the disk holding .* is full \(.* free when "
                                                  r"the save failed: \(sft rank 0\) save_checkpoint failed: "
                                                  r"OSError: .* No space left") as failed:
            trainer.checkpoints.save()
        assert isinstance(failed.value.__cause__, WorkerError)
    finally:
        trainer.close()
    assert list((tmp_path / "checkpoints").iterdir()) == []  # begin() made a temp dir; abort() removed it
