"""DAPO helpers (Yu et al. 2025, arXiv:2503.14476) the trainer can switch on for the GRPO family.

- `overlong_penalty`: soft overlong punishment, a length-dependent reward added to each score.
- `filter_groups`: dynamic sampling's filter, dropping prompts whose samples all scored the same
  (their group-relative advantage is zero, so they carry no gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.utils import group_index


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int], max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment `[batch]` float32, to be added to the scores.

    With L the response length and the soft zone (max_len - buffer_len, max_len]:
    0 for L <= max_len - buffer_len; ((max_len - buffer_len) - L) / buffer_len * penalty_factor inside
    the zone (falling linearly to -penalty_factor at max_len); -penalty_factor for L > max_len.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}"
        )
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    expected = max_len - buffer_len
    penalty = -(lengths - expected).clamp(min=0.0, max=float(buffer_len)) / buffer_len
    return penalty * penalty_factor


def filter_groups(
    scores: torch.Tensor | Sequence[float], group_ids: Sequence[Any] | np.ndarray | torch.Tensor
) -> torch.Tensor:
    """Keep mask `[batch]` bool: False on every row of a group whose scores are all equal.

    A group of one is kept (its spread is undefined, as in verl's DAPO recipe).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64).flatten()
    index, n_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    high = scores.new_full((n_groups,), -torch.inf).scatter_reduce(0, index, scores, "amax")
    low = scores.new_full((n_groups,), torch.inf).scatter_reduce(0, index, scores, "amin")
    size = torch.bincount(index, minlength=n_groups)
    keep = (high > low) | (size == 1)
    return keep[index]
