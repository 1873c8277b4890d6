"""Checkpoints of a run: what is saved each `trainer.save_every` steps, and resuming from one.

A checkpoint holds the workers' sharded model + optimizer state, lr schedules and RNG (written by the
workers themselves, `save_checkpoint`, one directory per trained role), the Hugging Face assets export
needs (beside the trainer's `model_role`), and the controller's state: the step, the data-loader
position, the bad-step counter and what else the trainer keeps (the RL trainer's KL controller), its
RNG, and the resolved config. It is written to a temporary directory and renamed when complete (see
`hybridflow.checkpoint`), so a crash mid-save leaves the previous checkpoint usable.
"""

from __future__ import annotations

from typing import Any

from hybridflow.checkpoint import (CheckpointManager, check_compatible, estimate_checkpoint_bytes,
                                   load_controller_state, read_config, save_controller_state, save_hf_assets)
from hybridflow.config.validate import needs_critic


def checkpoint_bytes(models: list[tuple[str, str]], trust_remote_code: bool = False) -> int:
    """One checkpoint's size, before any weights load: each trained model's fp32 master weights plus AdamW's
    two moments, counted by `estimate_checkpoint_bytes` on a meta-device copy built from its config.
    `models`: (path, head) pairs, head "lm" (a causal LM) or "value" (a critic: a one-label token classifier)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    total = 0
    for path, head in models:
        auto_class, overrides = ((AutoModelForCausalLM, {}) if head == "lm"
                                 else (AutoModelForTokenClassification, {"num_labels": 1}))
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        total += estimate_checkpoint_bytes(model)
    return total


def checkpoint_bytes_needed(cfg: Any) -> int:
    """`checkpoint_bytes` of an RL run: the policy, and the critic when there is one."""
    models = [(cfg.model.path, "lm")]
    if needs_critic(cfg):
        models.append((cfg.critic.model.path or cfg.model.path, "value"))
    return checkpoint_bytes(models, cfg.model.trust_remote_code)


class RunCheckpoints:
    """Saves and restores the whole state of a trainer (`hybridflow.trainer.base.Trainer`): the roles of its
    `checkpointed_roles()`, the controller state of its `checkpointed_state()`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.manager = CheckpointManager(trainer.cfg.trainer.output_dir, keep=trainer.cfg.trainer.keep_checkpoints)

    def save(self) -> None:
        """Writes the checkpoint of the current step (atomic) and prunes old ones."""
        t = self.trainer
        saved = self.manager.list()
        if saved and self.manager.step_of(saved[-1]) == t.step:
            return
        tmp = self.manager.begin(t.step)
        try:
            for name, role in t.checkpointed_roles().items():
                role.save_checkpoint(str(tmp / name))
            save_hf_assets(tmp / t.model_role, t.cfg.model.path)
            save_controller_state(tmp, t.step, t.cfg, t.checkpointed_state(),
                                  meta={"n_workers": t.cfg.trainer.n_workers, "model_path": t.cfg.model.path})
        except BaseException:
            self.manager.abort(tmp)  # a failed save (a worker died, the disk filled) leaves no temp dir
            raise
        self.manager.commit(t.step, tmp)

    def maybe_resume(self) -> None:
        """Continues from `trainer.resume` (auto: the newest complete checkpoint) when there is one."""
        t = self.trainer
        path = self.manager.resolve(t.cfg.trainer.resume)
        if path is None:
            return
        changed = check_compatible(read_config(path), t.cfg)
        for name, role in t.checkpointed_roles().items():
            role.load_checkpoint(str(path / name))
        state = load_controller_state(path, t.checkpointed_state())
        t.step = state.step
        print(f"resumed from {path} at step {t.step}" + (f"; changed: {'; '.join(changed)}" if changed else ""))
