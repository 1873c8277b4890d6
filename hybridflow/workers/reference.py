"""The reference policy: a frozen copy of the initial actor that scores responses (`ref_log_probs`).

`ReferenceModel` is the engine-level object (the actor holds one when it is colocated with its
reference); `ReferenceWorker` is the same as a standalone role, so `colocate(actor=..., ref=...)` or a
separate group both work. With `ref_param_offload` the frozen weights live on the CPU between calls.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.train import TrainEngine


class ReferenceModel:
    """A frozen `TrainEngine` (weights stored in the compute dtype, no optimizer)."""

    def __init__(self, model_cfg: Any, actor_cfg: Any, path: str | None, device: torch.device) -> None:
        cfg = _with_path(model_cfg, path)
        self.actor_cfg = actor_cfg
        self.offload = bool(getattr(actor_cfg, "ref_param_offload", False))
        self.engine = TrainEngine(cfg, None, head="lm", device=device)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)

    def log_probs(self, batch: Batch, temperature: float) -> Batch:
        """Batch{ref_log_probs [B, R]} for prompt + response rows."""
        if self.offload:
            self.engine.onload(params=True, optimizer=False)
        out = self.engine.infer(batch.tensors, micro_batch_size=self.actor_cfg.micro_batch_size,
                                max_tokens=self.actor_cfg.max_tokens_per_micro_batch, temperature=temperature,
                                pack=self.actor_cfg.use_packing)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)
        return Batch({"ref_log_probs": out["log_probs"]})


def _with_path(model_cfg: Any, path: str | None) -> Any:
    """`model_cfg` with `path` replaced (when given), leaving the caller's object untouched."""
    if path is None:
        return model_cfg
    import copy

    cfg = copy.copy(model_cfg)
    cfg.path = path
    return cfg


def temperature_of(batch: Batch, default: float) -> float:
    """The sampling temperature the rows were generated at (`meta["temperature"]`), else `default`;
    greedy rows (0) are scored at temperature 1."""
    t = float(batch.meta.get("temperature", default))
    return t if t > 0 else 1.0


class ReferenceWorker(Worker):
    """A standalone reference role: `compute_ref_log_probs(batch) -> Batch{ref_log_probs}`."""

    def __init__(self, model_cfg: Any, actor_cfg: Any, rollout_cfg: Any, ref_model_path: str | None = None) -> None:
        self.rollout_cfg = rollout_cfg
        self.ref = ReferenceModel(model_cfg, actor_cfg, ref_model_path, self.device)

    @register(Dispatch.DATA_PARALLEL)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        return self.ref.log_probs(batch, temperature_of(batch, self.rollout_cfg.temperature))
