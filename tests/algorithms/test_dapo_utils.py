"""DAPO helpers and the masked statistics / group helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import filter_groups, group_index, masked_mean, masked_var, masked_whiten, overlong_penalty


def test_overlong_penalty_hand_computed():
    out = overlong_penalty([10, 16, 17, 20, 25], max_len=20, buffer_len=4, penalty_factor=0.5)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty([1], max_len=4, buffer_len=8)


def test_filter_groups_drops_constant_groups_keeps_singletons():
    keep = filter_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), np.array(["a", "a", "b", "b", "c"], dtype=object))
    assert keep.tolist() == [False, False, True, True, True]


def test_group_index_first_appearance_order_and_errors():
    index, n = group_index(["x", "y", "x", 3], 4)
    assert index.tolist() == [0, 1, 0, 2] and n == 3
    with pytest.raises(ValueError, match="one id per row"):
        group_index(["x"], 2)
    with pytest.raises(ValueError, match="hashable"):
        group_index([["x"], ["y"]], 2)


def test_masked_statistics():
    values = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 6.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # unbiased over {1, 2, 3}
    white = masked_whiten(values, mask)
    assert white[mask == 1].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert masked_whiten(values, mask, shift_mean=False)[0, 0].item() == pytest.approx(1.0, abs=1e-6)
