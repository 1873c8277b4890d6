"""The 4-bit base's tensor (`quantized_base.to_nf4`, torchao's NF4Tensor): a linear layer's weight within NF4's
rounding, cut evenly into FSDP2's shards (each dequantizing to its rows), refused with the weight's name where its
blocks or rows cannot be shared; `dense` gives back a plain tensor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from hybridflow.engine.train.quantized_base import dense, is_nf4, to_nf4  # noqa: E402


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_nf4_weights_round_to_4_bits_and_shard_evenly(shards):
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    q = to_nf4(weight, "q_proj.weight", shards)
    assert is_nf4(q) and not is_nf4(dense(q)) and dense(q).dtype == weight.dtype
    error = (dense(q) - weight).abs().max()
    assert 0 < error < 0.1 * weight.abs().max()  # 16 levels between a block's extremes
    rows = 64 // shards
    for i, shard in enumerate(torch.chunk(q, shards)):  # what fully_shard does to a parameter
        assert torch.equal(dense(shard), dense(q)[i * rows:(i + 1) * rows])
    x = torch.randn(3, 64)
    assert torch.allclose(torch.nn.functional.linear(x, q), x @ dense(q).T, atol=1e-5)


def test_a_weight_that_cannot_be_shared_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model.quantization=nf4: down_proj.weight of shape \(3, 64\) cannot be stored"):
        to_nf4(torch.randn(3, 64), "down_proj.weight", 2)  # 3 rows over 2 ranks
    with pytest.raises(ValueError, match="trainer.n_workers"):
        to_nf4(torch.randn(1, 96), "k_proj.weight")  # 96 values: not whole 64-value blocks
