"""The fast decoder's projections and the loading of their weights in place.

`Linear` is y = x @ W.T (+ b), `F.linear` or, with `exact`, the invariant GEMM. `FusedLinear` stacks several HF
projections that share an input on the output dim (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`): its
`weight_loader` copies a shard at its offset, or the whole parameter when a checkpoint stores it fused in the same
order (Phi-3's `qkv_proj` and `gate_up_proj`). Others take `default_weight_loader`. Weights are only ever `copy_`-ed
into, never replaced, so captured CUDA graphs stay valid across updates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engine import invariant

Shard = str | tuple[str, int] | None  # a parameter's piece: a FusedLinear shard's name, or experts' (part, expert)


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard: Shard = None) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} does not match the parameter's {tuple(param.shape)}")
    param.data.copy_(tensor)


class Linear(nn.Linear):
    """y = x @ W.T (+ b): `F.linear`, or with `exact` the invariant GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool, exact: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(x, self.weight, self.bias) if self.exact else F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several HF projections sharing an input, stacked on the output dim: y = x @ W.T (+ b)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, exact: bool) -> None:
        self.offsets, start = {}, 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size
        super().__init__(in_features, start, bias, exact)

    def shard_ids(self, leaf: str) -> list[str]:
        """The pieces a full load of `weight` or `bias` consists of."""
        return list(self.offsets)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None = None) -> None:
        """A shard at its offset; shard None: the whole parameter (a checkpoint that stores it fused, as Phi-3's
        `qkv_proj` and `gate_up_proj`, in the same order)."""
        if shard is None:
            default_weight_loader(param.data, tensor)
            return
        if shard not in self.offsets:
            raise ValueError(f"fused parameter needs a shard id among {list(self.offsets)} or none, got {shard!r}")
        start, size = self.offsets[shard]
        default_weight_loader(param.data[start:start + size], tensor)
