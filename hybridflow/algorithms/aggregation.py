"""Loss aggregation: turn a per-token loss matrix `[batch, response_len]` into a scalar.

Modes (`AGG_MODES`), with m the mask, L the loss matrix, row sum S_i = sum_t L_it m_it,
row count n_i = sum_t m_it and R = response_len:
- `token-mean`: sum_i S_i / sum_i n_i — every real token weighs the same (DAPO's choice).
- `seq-mean-token-sum`: mean over rows of S_i.
- `seq-mean-token-mean`: mean over rows of S_i / n_i (the GRPO paper's choice).
- `seq-mean-token-sum-norm`: sum_i S_i / R, R a constant (Dr.GRPO, arXiv:2503.20783).
The two `seq-mean-token-*` means leave out fully masked rows (n_i = 0).

Micro-batch / data-parallel invariance: when a batch is split into pieces (micro-batches, ranks),
pass the whole batch's counts: `global_token_count` = sum_i n_i (token-mean) and
`global_seq_count` = number of rows with n_i > 0 (seq-mean modes). Each piece then returns
`sum of its terms / global count`, so the pieces' losses add up exactly to the whole batch's loss
(and their gradients to its gradient). `seq-mean-token-sum-norm` is a plain sum over rows divided
by the constant R, so it is additive as it is; fix R with `response_len` when pieces are padded to
different widths.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.registry import did_you_mean
from hybridflow.algorithms.utils import check_shapes, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    response_len: int | None = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` `[batch, R]` over `mask` `[batch, R]` with `mode` -> a scalar tensor.

    Without global counts the denominators are this batch's own (token count, or number of rows with
    at least one token; an empty mask gives 0). With them, see the module docstring.
    `response_len` is the normaliser of `seq-mean-token-sum-norm` (default `loss_mat.shape[-1]`).
    """
    if mode not in AGG_MODES:
        hint = did_you_mean(str(mode), list(AGG_MODES))
        raise ValueError(f"unknown aggregation mode {mode!r}.{hint} Valid: {AGG_MODES}")
    check_shapes("loss_mat", loss_mat=loss_mat, mask=mask)
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        count = mask.sum() if global_token_count is None else global_token_count
        return masked_sum(loss_mat, mask) / _positive(count)
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum-norm":
        return row_sum.sum() / (loss_mat.shape[-1] if response_len is None else response_len)
    row_count = mask.sum(dim=-1)
    has_tokens = row_count > 0
    row_value = row_sum if mode == "seq-mean-token-sum" else row_sum / row_count.clamp(min=1e-8)
    row_value = torch.where(has_tokens, row_value, torch.zeros_like(row_value))
    count = has_tokens.sum() if global_seq_count is None else global_seq_count
    return row_value.sum() / _positive(count)


def _positive(count: Count) -> Count:
    """The count itself, or 1 where it is 0 (an empty batch then aggregates to 0, not NaN)."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1
