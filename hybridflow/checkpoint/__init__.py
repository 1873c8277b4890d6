"""Checkpoints that resume exactly, export to Hugging Face, and stop runs safely.

One checkpoint is written like this (controller and workers; see docs/checkpoints.md):

    manager = CheckpointManager(cfg.trainer.output_dir, keep=cfg.trainer.keep_checkpoints)
    tmp = manager.begin(step)                                       # controller
    save_worker_state(tmp / "actor", model, optimizer, {"lr": sched})   # every actor rank
    save_hf_assets(tmp / "actor", cfg.model.path)                   # controller, for export
    save_controller_state(tmp, step, cfg, {"kl": kl_ctl, "data": loader_position})
    manager.commit(step, tmp)                                       # atomic rename, prune
                                                                    # (manager.abort(tmp) on failure)

and resumed with `manager.resolve(cfg.trainer.resume)` (every file checked against the manifest's checksums), `check_compatible(read_config(ckpt), cfg)`,
`load_worker_state(ckpt / "actor", ...)` and `load_controller_state(ckpt, ...)`.
"""

from hybridflow.checkpoint.bad_steps import BadStepCounter, TrainingDiverged, non_finite_parameter
from hybridflow.checkpoint.compat import IncompatibleCheckpoint, check_compatible, check_model_config
from hybridflow.checkpoint.export import export_hf, main_export, save_hf_assets
from hybridflow.checkpoint.lock import RunLock, check_unlocked
from hybridflow.checkpoint.manager import CheckpointManager, check_writable, find_checkpoint
from hybridflow.checkpoint.manifest import CheckpointError, is_complete, verify
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state
from hybridflow.utils.stop_signals import PREEMPTED_EXIT_CODE, GracefulStop, Interrupted, Preempted, StopAtOnce
from hybridflow.checkpoint.state import (
    ControllerState,
    estimate_checkpoint_bytes,
    load_controller_state,
    load_model_state,
    load_worker_state,
    read_config,
    read_full_model_state,
    read_meta,
    save_controller_state,
    save_model_state,
    save_worker_state,
)

__all__ = [
    "PREEMPTED_EXIT_CODE", "BadStepCounter", "CheckpointError", "CheckpointManager", "ControllerState",
    "GracefulStop", "IncompatibleCheckpoint", "Interrupted", "Preempted", "RunLock", "StopAtOnce", "TrainingDiverged",
    "capture_rng_state", "check_compatible", "check_model_config", "check_unlocked", "check_writable",
    "estimate_checkpoint_bytes", "export_hf",
    "find_checkpoint", "is_complete", "load_controller_state", "load_model_state", "load_worker_state",
    "main_export", "non_finite_parameter", "read_config", "read_full_model_state", "read_meta", "restore_rng_state",
    "save_controller_state", "save_hf_assets", "save_model_state", "save_worker_state", "verify",
]
