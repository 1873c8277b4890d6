"""Checkpoints of a run: what is saved each `trainer.save_every` steps, and resuming from one.

A checkpoint holds the workers' sharded model + optimizer state, lr schedules and RNG (written by the
workers themselves, `save_checkpoint`, one directory per trained role), the Hugging Face assets export
needs (beside the trainer's `model_role`), and the controller's state: the step, the data-loader
position, the bad-step counter and what else the trainer keeps (the RL trainer's KL controller), its
RNG, and the resolved config. It is written to a temporary directory and renamed when complete (see
`hybridflow.checkpoint`), so a crash mid-save leaves the previous checkpoint usable. Everything that can
refuse a resume (a damaged or incompatible checkpoint, checkpoints this run would mix with) is checked
before any model loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hybridflow.checkpoint import (CheckpointError, CheckpointManager, IncompatibleCheckpoint, check_compatible,
                                   check_model_config, check_writable, estimate_checkpoint_bytes,
                                   load_controller_state, read_config, read_meta, save_controller_state,
                                   save_hf_assets)
from hybridflow.checkpoint.export import HF_DIR, head_config
from hybridflow.checkpoint.fingerprint import base_changed, base_fingerprint
from hybridflow.checkpoint.manager import disk_full, human_bytes
from hybridflow.checkpoint.manifest import checkpoint_bytes_on_disk
from hybridflow.config.role_needs import carries_images, needs_critic
from hybridflow.controller import per_rank


def checkpoint_bytes(models: list[tuple[str, str, Any]], trust_remote_code: bool = False, images: bool = False) -> int:
    """One checkpoint's size, before any weights load: each trained model's fp32 master weights plus AdamW's
    two moments, counted by `estimate_checkpoint_bytes` on a meta-device copy built from its config (with
    LoRA, of its trained parameters alone). `models`: (path, head, lora section) triples, head "lm" (a causal
    LM) or "value" (a critic: a one-label token classifier); `images`: the run's prompts carry images (a Qwen3.5
    checkpoint then trains with its tower: `lm_class.TEXT_FIRST_FAMILIES`)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    from hybridflow.engine.train.lora import trainable_params
    from hybridflow.utils.lm_class import lm_auto_class

    total = 0
    for path, head, lora in models:
        overrides = {} if head == "lm" else {"num_labels": 1}
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
        auto_class = lm_auto_class(config, images) if head == "lm" else AutoModelForTokenClassification
        if lora.rank > 0:  # fp32 adapters and their two moments
            total += 3 * 4 * trainable_params(config, lora, head, trust_remote_code, images)
            continue
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        total += estimate_checkpoint_bytes(model)
    return total


def checkpoint_bytes_needed(cfg: Any) -> int:
    """`checkpoint_bytes` of an RL run: the policy, and the critic when there is one."""
    models = [(cfg.model.path, "lm", cfg.actor.lora)]
    if needs_critic(cfg):
        models.append((cfg.critic.model.path or cfg.model.path, "value", cfg.critic.lora))
    return checkpoint_bytes(models, cfg.model.trust_remote_code, carries_images(cfg))


class RunCheckpoints:
    """Saves and restores the whole state of a trainer (`hybridflow.trainer.base.Trainer`): the roles of its
    `checkpointed_roles()`, the controller state of its `checkpointed_state()`.

    Built before any model loads, it finds the checkpoint to resume from (`trainer.resume`, verified
    against its checksums), refuses one saved with an incompatible config or model, or whose LoRA adapters
    were trained on other base weights than `model.path` holds now (each checkpoint records the fingerprint
    of its LoRA roles' bases, `hybridflow.checkpoint.fingerprint`), and refuses to start where this run
    would mix with checkpoints it does not continue from (`clashing`) unless `trainer.discard_checkpoints`
    lets it delete them (`open_checkpoints`, which `hybridflow config` runs with nothing written). `restore()`
    then loads the checkpoint into the started workers; `save()` writes one per call, checking the free space
    first.
    """

    def __init__(self, trainer: Any, estimate_bytes: int) -> None:
        self.trainer = trainer
        self.estimate_bytes = estimate_bytes
        self.lora_bases = base_fingerprints(trainer.lora_bases(trainer.cfg))
        self.manager, self.resume_from, self.changed = open_checkpoints(trainer.cfg, trainer.model_role,
                                                                        trainer.model_head, self.lora_bases)

    def save(self) -> Path:
        """Writes the checkpoint of the current step (atomic) and prunes old ones; returns it. The space
        check and a failed write (its temp dir removed, the message naming the disk's free space) are
        `CheckpointManager.begin`'s and `save_failed`'s."""
        t = self.trainer
        self._refuse_non_finite(t.step)
        tmp = self.manager.begin(t.step, min_free_bytes=self.estimate_bytes)
        try:
            for name, role in t.checkpointed_roles().items():
                role.save_checkpoint(str(tmp / name))
            save_hf_assets(tmp / t.model_role, t.cfg.model.path, t.model_head, t.cfg.model.quantization,
                           carries_images(t.cfg))
            save_controller_state(tmp, t.step, t.cfg, t.checkpointed_state(),
                                  meta={"n_workers": t.cfg.trainer.n_workers, "model_path": t.cfg.model.path,
                                        "lora_bases": self.lora_bases})
        except BaseException as exc:
            free = shutil.disk_usage(self.manager.root).free
            self.manager.abort(tmp)  # a failed save (a worker died, the disk filled) leaves no temp dir
            if disk_full(exc, free):
                raise CheckpointError(save_failed(self.manager, t.step, exc, free)) from exc
            raise
        return self.manager.commit(t.step, tmp)

    def _refuse_non_finite(self, step: int) -> None:
        """Refuses (`CheckpointError`, before anything is written) to save weights holding NaN or inf, naming the
        step, the role, the rank and the parameter: such a checkpoint would only resume the ruin, and keep-last-k
        would prune the good ones in its favour."""
        for name, role in self.trainer.checkpointed_roles().items():
            bad = [(rank, what) for rank, what in enumerate(per_rank(role.non_finite_weights)()) if what]
            if bad:
                rank, what = bad[0]
                latest = self.manager.latest()
                kept = (f"the previous checkpoint {latest} is kept intact: resume from it (trainer.resume=auto) with "
                        f"a lower learning rate or a smaller grad_clip" if latest is not None else
                        "no checkpoint was saved before it")
                raise CheckpointError(f"cannot save step {step}: the {name} weights are not finite: {what} on rank "
                                      f"{rank}; no checkpoint is written with them and the run stops; {kept}")

    def restore(self) -> None:
        """Loads the checkpoint found at construction into the started workers and the controller."""
        t, path = self.trainer, self.resume_from
        if path is None:
            return
        for name, role in t.checkpointed_roles().items():
            role.load_checkpoint(str(path / name))
        state = load_controller_state(path, t.checkpointed_state())
        t.step = state.step
        print(f"resumed from {path} at step {t.step}"
              + (f"; changed since the checkpoint (the new values apply): {'; '.join(self.changed)}"
                 if self.changed else ""))


def base_fingerprints(bases: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Role -> {path, fingerprint} of each LoRA role's base model (`Trainer.lora_bases`), as a checkpoint records it."""
    return {role: {"path": path, "fingerprint": base_fingerprint(path)} for role, path in bases.items()}


def open_checkpoints(cfg: Any, model_role: str, model_head: str, lora_bases: dict[str, dict[str, Any]],
                     dry: bool = False) -> tuple[CheckpointManager, Path | None, list[str]]:
    """The output directory's checkpoints, the one a run resumes from (None: it starts fresh) and the keys changed
    since it was saved, checked before any model loads (see `RunCheckpoints`): refuses (`CheckpointError`,
    `IncompatibleCheckpoint`) a damaged or incompatible checkpoint, one whose LoRA bases changed (`lora_bases`:
    `base_fingerprints`), checkpoints this run would mix with unless `trainer.discard_checkpoints` (which deletes
    them), and a disk without room for a checkpoint as large as the newest kept one.
    `dry=True` (`hybridflow config`): the same checks with nothing written: damaged checkpoints are not set aside,
    stale temp dirs stay, discarded checkpoints are not deleted (and not counted)."""
    manager = CheckpointManager(cfg.trainer.output_dir, keep=cfg.trainer.keep_checkpoints)
    resume_from = manager.resolve(cfg.trainer.resume, tidy=not dry)
    changed: list[str] = []
    if resume_from is not None:
        changed = check_compatible(read_config(resume_from), cfg)
        check_hf_config(resume_from / model_role, cfg.model, model_head)
        recorded = read_meta(resume_from).get("lora_bases", {})
        problems = [base_changed(role, recorded.get(role), base["path"], base["fingerprint"])
                    for role, base in lora_bases.items()]
        if any(problems):
            raise IncompatibleCheckpoint([p for p in problems if p])
    clash = clashing(manager, resume_from)
    if dry and str(cfg.trainer.resume).strip().lower() == "auto":
        clash = []  # those newer than the checkpoint resumed are damaged, and the run sets them aside
    if clash and not cfg.trainer.discard_checkpoints:
        raise CheckpointError(clash_message(manager, resume_from, clash))
    if clash and not dry:
        for path in clash:
            manager.remove(path)
        print(f"trainer.discard_checkpoints=true: deleted {', '.join(p.name for p in clash)} from {manager.root}")
    newest = next((p for p in reversed(manager.list()) if p not in clash), None) if dry else manager.latest()
    if newest is not None:  # the real size beats the estimate check_writable had
        check_writable(cfg.trainer.output_dir, checkpoint_bytes_on_disk(newest), create=not dry)
    return manager, resume_from, changed


def check_hf_config(role_dir: Path, model_cfg: Any, head: str = "lm") -> None:
    """Refuse (`IncompatibleCheckpoint`) a `model.path` whose architecture differs from the one the checkpoint's
    role was trained from (its saved `hf/config.json`, of a model with `head`), before any weights load."""
    saved = role_dir / HF_DIR / "config.json"
    if saved.is_file():
        new = head_config(model_cfg.path, head, model_cfg.trust_remote_code)
        check_model_config(json.loads(saved.read_text()), new.to_dict(), role_dir.name)


def clashing(manager: CheckpointManager, resume_from: Path | None) -> list[Path]:
    """The checkpoints in the output dir that this run would mix with: every one when it starts fresh or
    continues another directory's checkpoint; those after the resumed step when it continues an older one."""
    existing: list[Path] = manager.existing()
    if resume_from is None or resume_from.parent != manager.root:
        return existing
    return [p for p in existing if p.name > resume_from.name]  # step_<8 digits>: names sort by step


def clash_message(manager: CheckpointManager, resume_from: Path | None, clash: list[Path]) -> str:
    names = ", ".join(p.name for p in clash)
    what = ("this run starts fresh (trainer.resume=never)" if resume_from is None else
            f"this run continues {resume_from}, from another directory" if resume_from.parent != manager.root else
            f"this run continues the older {resume_from.name}")
    return (f"{manager.root} holds checkpoints of another run ({names}) and {what}: its checkpoints would "
            f"mix with them. Use another trainer.output_dir, resume the newest (trainer.resume=auto), or set "
            f"trainer.discard_checkpoints=true to delete them")


def save_failed(manager: CheckpointManager, step: int, exc: BaseException, free: int) -> str:
    """The message of a save that failed on a full disk."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    latest = manager.latest()
    return (f"cannot save step {step}: the disk holding {manager.root} is full ({human_bytes(free)} free when "
            f"the save failed: {first}); the partial checkpoint was removed, the previous checkpoints and the "
            f"logs are intact. Free space and run the same command again to resume"
            + (f" from {latest.name}" if latest is not None else ""))
