"""The one way the training side reduces small values (counts, metric sums) over its data-parallel ranks.

Values are reduced on the worker's own device: a GPU group's default process group sends CUDA tensors
through NCCL (`hybridflow.controller.runtime.dist_backend`), a CPU group uses gloo, and an NCCL-only group
would refuse CPU tensors, so the worker's device is the one placement every backend accepts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(values: torch.Tensor, device: torch.device, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """`values` reduced with `op` over the default process group (as they are without torch.distributed),
    returned on the CPU; the caller's tensor is not modified."""
    if not dist.is_initialized():
        return values.cpu()
    reduced = values.to(device, copy=True)
    dist.all_reduce(reduced, op=op)
    return reduced.cpu()
