"""Inputs and comparisons shared by the worker tests that run an actor on two ranks."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch


def rank_prompts(rank: int) -> Batch:
    """Three left-padded prompts (5, 3 and 2 tokens) drawn per rank, with uids and a fixed sampling seed."""
    g = torch.Generator().manual_seed(10 + rank)
    prompts = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, length in enumerate((5, 3, 2)):
        prompts[i, 5 - length:] = torch.randint(4, 250, (length,), generator=g)
        mask[i, 5 - length:] = 1
    return Batch({"prompts": prompts, "attention_mask": mask}, {"uid": [f"r{rank}p{i}" for i in range(3)]},
                 meta={"sampling": {"seed": 3}})


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |a - b| where mask is set."""
    return float(((a - b).abs() * mask).max())
