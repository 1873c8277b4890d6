"""The rollout engine's feed-forward blocks: a dense gated MLP (SwiGLU, or the config's gated activation) and the
choice between it and a `SparseMoE` block for each layer of a mixture of experts."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.engine import invariant
from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.kernels import silu_mul
from hybridflow.engine.rollout.linear import FusedLinear, Linear
from hybridflow.engine.rollout.sparse_moe import SparseMoE
from hybridflow.utils.moe_spec import moe_spec


def gated_act(config):
    """[T, 2I] gate and up side by side -> act(gate) * up [T, I] (the fused kernel for SiLU)."""
    name = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma 3 names it hidden_activation
    if name == "silu":
        return silu_mul
    from transformers.activations import ACT2FN

    act = ACT2FN[name]
    return lambda gate_up: act(gate_up[:, :gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2:]


class MLP(nn.Module):
    """A SwiGLU MLP of width `size` (default the config's `intermediate_size`)."""

    def __init__(self, config, exact: bool, size: int | None = None) -> None:
        super().__init__()
        size, bias = size or config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate": size, "up": size}, bias, exact)
        self.down_proj = Linear(size, config.hidden_size, bias, exact)
        self.act = gated_act(config)
        self.exact, self.size = exact, size

    def forward(self, x: torch.Tensor, meta: AttnMeta | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.exact:
            return self.down_proj(invariant.silu_mul(gate_up[:, :self.size], gate_up[:, self.size:]))
        return self.down_proj(self.act(gate_up))


def layer_mlp(config, layer_index: int, exact: bool, moe_kernel: str) -> nn.Module:
    """The layer's MLP: a `SparseMoE` block in a mixture of experts' sparse layers (never exact: exact mode
    refuses mixtures of experts), else a dense one."""
    spec = moe_spec(config)
    if spec is None or not spec.is_sparse(layer_index):
        return MLP(config, exact, spec.dense_intermediate if spec else None)
    shared = MLP(config, exact, spec.shared_intermediate) if spec.shared_intermediate else None
    return SparseMoE(spec, config.hidden_size, gated_act(config), moe_kernel, shared)
