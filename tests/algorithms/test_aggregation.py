"""`aggregate`: hand-computed modes, fully masked rows, and micro-batch invariance with global counts."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms import AGG_MODES, aggregate

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the empty third row is left out
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 3),
    ],
)
def test_modes_hand_computed(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_response_len_sets_the_sum_norm_constant():
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", response_len=7).item() == pytest.approx(1.0)


def test_empty_mask_gives_zero_not_nan():
    for mode in AGG_MODES:
        assert aggregate(LOSS, torch.zeros(3, 3), mode).item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_counts_add_up_to_the_whole(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([6, 0, 3, 1, 5, 2, 6, 4])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    loss_mat = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    whole = aggregate(loss_mat, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = [
        aggregate(loss_mat[rows], mask[rows], mode, global_token_count=tokens, global_seq_count=seqs)
        for rows in (slice(0, 3), slice(3, 8))
    ]
    total = parts[0] + parts[1]
    (part_grad,) = torch.autograd.grad(total, loss_mat)
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)
    assert torch.allclose(part_grad, whole_grad, atol=1e-12)


def test_unknown_mode_and_shape_mismatch_are_clear():
    with pytest.raises(ValueError, match="Did you mean 'token-mean'"):
        aggregate(LOSS, MASK, "token_mean")
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(LOSS, MASK[:, :2], "token-mean")
