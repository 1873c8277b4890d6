"""Masked statistics, input checks and group indexing shared by the algorithm functions.

Everything here is a pure tensor function: no I/O, no distributed calls. Tensors are
`[batch, response_len]` unless said; a mask is 1.0 on real response tokens and 0.0 after the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

WHITEN_EPS = 1e-8


def check_shapes(reference: str, **tensors: torch.Tensor | None) -> None:
    """Raise `ValueError` unless every given tensor has the shape of the one named `reference`.

    `None` entries are skipped. The first tensor must be 2-D (`[batch, response_len]`).
    """
    ref = tensors[reference]
    if ref is None or ref.dim() != 2:
        shape = None if ref is None else tuple(ref.shape)
        raise ValueError(f"{reference} must be a 2-D [batch, response_len] tensor, got shape {shape}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference} has shape {tuple(ref.shape)}; "
                f"all [batch, response_len] inputs must match"
            )


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values * mask` (over `dim`, or everything); masked-out NaN/inf never leak in."""
    weighted = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`masked_sum / mask count` (over `dim`, or everything); 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=torch.finfo(values.dtype).tiny)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked entries (a scalar); unbiased uses n / (n - 1).

    Raises `ValueError` when the mask holds fewer than two entries (one with `unbiased=False`).
    """
    count = float(mask.sum())
    if count < (2 if unbiased else 1):
        raise ValueError(
            f"masked variance needs at least {2 if unbiased else 1} masked entries, the mask holds {count:g}; "
            f"use a larger batch"
        )
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return var * (count / (count - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(values - mean) * rsqrt(var + 1e-8)`, mean and unbiased var taken over the mask.

    Applied to every position (masked-out ones too); with `shift_mean=False` the mean is added back.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def group_index(group_ids: Sequence[Any] | np.ndarray | torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """Map one hashable id per row to `(index [batch] long, n_groups)`, groups numbered by first appearance.

    `group_ids` is a list, numpy array or 1-D tensor of length `batch` (the `uid` row field).
    """
    ids = group_ids.tolist() if isinstance(group_ids, (torch.Tensor, np.ndarray)) else list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch} rows; give one id per row")
    numbering: dict[Any, int] = {}
    try:
        index = [numbering.setdefault(gid, len(numbering)) for gid in ids]
    except TypeError as err:
        raise ValueError(f"group_ids must be hashable (str, int, ...): {err}") from None
    return torch.tensor(index, dtype=torch.long), len(numbering)


def group_stats(
    scores: torch.Tensor, group_ids: Sequence[Any] | np.ndarray | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row `(group size, group mean, group unbiased std)` for `scores` `[batch]`, in float64.

    Rows of a group of one get mean 0 and std 1 (the GRPO convention); callers override as needed.
    """
    index, n_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    s = scores.detach().double()
    size = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, index, torch.ones_like(s))
    total = torch.zeros_like(size).index_add_(0, index, s)
    mean = total / size
    sq_dev = torch.zeros_like(size).index_add_(0, index, (s - mean[index]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return size[index], mean[index], std[index]
