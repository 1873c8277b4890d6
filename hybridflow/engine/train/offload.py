"""Moving a sharded model's parameters and an optimizer's state between the GPU and host memory.

A colocated rollout engine needs the GPU memory while it generates: the actor's parameter shards and
AdamW state go to the CPU, and come back before training. Every move makes a fresh copy (so a round
trip through the same device is still a real one), and FSDP2 re-points its shard views after a
module-wide move (`FSDPModule._apply`).
"""

from __future__ import annotations

import torch


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, copy=True)


def move_params(model: torch.nn.Module, device: torch.device) -> None:
    """Parameters and buffers of `model` (their local shards) onto `device`."""
    model._apply(lambda t: _copy_to(t, device))


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every tensor of the optimizer state onto `device` (the `step` counters stay where AdamW keeps them).
    An optimizer whose state always lives in host memory (`state_on_host`, the CPU-offloaded AdamW) is
    left alone."""
    if getattr(optimizer, "state_on_host", False):
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = _copy_to(value, device)
