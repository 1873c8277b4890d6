"""Non-finite steps and weights: skip a step whose loss or gradient norm is NaN/inf, stop after K in a row; find
a model's first non-finite parameter (`non_finite_parameter`), so that no checkpoint is written with it.

    guard = BadStepCounter(max_in_row=5)
    if guard.update(step, loss=loss, grad_norm=grad_norm):   # False → skip optimizer.step()
        optimizer.step()

`update` counts skipped steps (`skipped_total`, for the `train/skipped_steps` metric) and raises
`TrainingDiverged` on the K-th non-finite step in a row. It never touches checkpoints, so the ones
already written stay intact and resumable. Its `state_dict()` makes the counts survive a resume.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class TrainingDiverged(RuntimeError):
    """K non-finite steps in a row: the run is stopped; saved checkpoints are intact."""


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


class BadStepCounter:
    """Counts non-finite steps; `max_in_row` (K >= 1) consecutive ones raise `TrainingDiverged`."""

    def __init__(self, max_in_row: int):
        if not isinstance(max_in_row, int) or max_in_row < 1:
            raise ValueError(f"max_in_row={max_in_row!r}: must be an int >= 1")
        self.max_in_row = max_in_row
        self.in_row = 0
        self.skipped_total = 0

    def update(self, step: int, **values: Any) -> bool:
        """True when every value (floats or tensors, e.g. loss=..., grad_norm=...) is finite and the
        step may be applied; False when it must be skipped. Raises on the K-th bad step in a row."""
        if not values:
            raise ValueError("update() needs at least one value to check, e.g. loss=..., grad_norm=...")
        bad = {name: value for name, value in values.items() if not _finite(value)}
        if not bad:
            self.in_row = 0
            return True
        self.in_row += 1
        self.skipped_total += 1
        if self.in_row >= self.max_in_row:
            shown = ", ".join(f"{name}={_describe(value)}" for name, value in bad.items())
            raise TrainingDiverged(
                f"training diverged: {self.in_row} non-finite steps in a row (the last at step {step}: "
                f"{shown}); stopped without touching the saved checkpoints. Resume from the last one "
                f"with a lower learning rate, stronger gradient clipping or another seed "
                f"(limit: {self.max_in_row} in a row)")
        return False

    def state_dict(self) -> dict[str, int]:
        return {"in_row": self.in_row, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_row, self.skipped_total = int(state["in_row"]), int(state["skipped_total"])


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return f"tensor with {int((~torch.isfinite(value)).sum())} non-finite of {value.numel()}"
    return str(float(value))


def non_finite_parameter(model: torch.nn.Module) -> str | None:
    """`name (k of n values are NaN or inf)` of the first trained floating-point parameter of `model` holding a
    non-finite value, looking at this process's shards alone (an FSDP2 DTensor's local part); None when all are
    finite. Frozen parameters (a LoRA base, a 4-bit NF4 base, which has no elementwise ops) are not looked at:
    only an update can make a weight non-finite after it loaded. One device sync for the whole model, then one
    for the parameter it names."""
    params = [(name, p.to_local() if isinstance(p, DTensor) else p.detach())
              for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    if not params:
        return None
    finite = torch.stack([torch.isfinite(local).all() for _, local in params]).tolist()
    for (name, local), ok in zip(params, finite):
        if not ok:
            return f"{name} ({int((~torch.isfinite(local)).sum())} of {local.numel()} values are NaN or inf)"
    return None
