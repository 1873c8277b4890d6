"""Checkpoints of an RL run: what is saved each `trainer.save_every` steps, and resuming from one.

A checkpoint holds the workers' sharded model + optimizer state, lr schedules and RNG (written by the
workers themselves, `save_checkpoint`), the Hugging Face assets export needs, and the controller's
state: the step, the data-loader position, the KL controller, the bad-step counter, its RNG, and the
resolved config. It is written to a temporary directory and renamed when complete (see
`hybridflow.checkpoint`), so a crash mid-save leaves the previous checkpoint usable.
"""

from __future__ import annotations

from typing import Any

from hybridflow.checkpoint import (CheckpointManager, check_compatible, estimate_checkpoint_bytes,
                                   load_controller_state, read_config, save_controller_state, save_hf_assets)
from hybridflow.config.validate import needs_critic


def checkpoint_bytes_needed(cfg: Any) -> int:
    """One checkpoint's size, before any weights load: every trained model's fp32 master weights plus
    AdamW's two moments, counted by `estimate_checkpoint_bytes` on a meta-device copy built from the model's
    config (the policy as a causal LM; the critic, when there is one, as a one-label token classifier)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    models = [(cfg.model.path, AutoModelForCausalLM, {})]
    if needs_critic(cfg):
        models.append((cfg.critic.model.path or cfg.model.path, AutoModelForTokenClassification, {"num_labels": 1}))
    total = 0
    for path, auto_class, overrides in models:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code, **overrides)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
        total += estimate_checkpoint_bytes(model)
    return total


class RunCheckpoints:
    """Saves and restores the whole state of an `RLTrainer`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.manager = CheckpointManager(trainer.cfg.trainer.output_dir, keep=trainer.cfg.trainer.keep_checkpoints)

    def stateful(self) -> dict[str, Any]:
        t = self.trainer
        return {"data": t.train_loader, "kl_ctrl": t.kl_ctrl, "bad_steps": t.bad_steps}

    def roles(self) -> dict[str, Any]:
        roles = {"actor": self.trainer.roles.actor}
        if self.trainer.roles.critic is not None:
            roles["critic"] = self.trainer.roles.critic
        return roles

    def save(self) -> None:
        """Writes the checkpoint of the current step (atomic) and prunes old ones."""
        t = self.trainer
        saved = self.manager.list()
        if saved and self.manager.step_of(saved[-1]) == t.step:
            return
        tmp = self.manager.begin(t.step)
        try:
            for name, role in self.roles().items():
                role.save_checkpoint(str(tmp / name))
            save_hf_assets(tmp / "actor", t.cfg.model.path)
            save_controller_state(tmp, t.step, t.cfg, self.stateful(),
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
        for name, role in self.roles().items():
            role.load_checkpoint(str(path / name))
        state = load_controller_state(path, self.stateful())
        t.step = state.step
        print(f"resumed from {path} at step {t.step}" + (f"; changed: {'; '.join(changed)}" if changed else ""))
