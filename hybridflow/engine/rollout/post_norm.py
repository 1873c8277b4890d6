"""OLMo 2's decoder layer: each block's output is RMS-normalised before it joins the residual stream.

Llama-style layers normalise a block's input (`model.DecoderLayer`); OLMo 2 (HF's `Olmo2DecoderLayer`) feeds the
residual stream to attention and the MLP as it is and normalises what they return:

    h = h + post_attention_layernorm(attn(h));  h = h + post_feedforward_layernorm(mlp(h))

The attention (q/k norms over the whole projections, as OLMoE's) and the MLP are `model`'s. Its norms scale the
fp32 row before rounding (`kernels.add_rms_norm`'s `round_first=False`). The layer keeps `DecoderLayer`'s
protocol, (h, pending output): the last layer's output is added by the model's final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.mlp import layer_mlp
from hybridflow.engine.rollout.model import Attention, family_norm


class PostNormDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, backend: str, moe_kernel: str = "grouped_mm") -> None:
        super().__init__()
        exact = backend == "exact"
        self.self_attn = Attention(config, layer_index, backend)
        self.post_attention_layernorm = family_norm(config.hidden_size, config, exact)
        self.mlp = layer_mlp(config, layer_index, exact, moe_kernel)
        self.post_feedforward_layernorm = family_norm(config.hidden_size, config, exact)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor | None, rope,
                meta: AttnMeta, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's pending output delta -> (h, this layer's output)."""
        if delta is not None:
            h = h + delta
        h = h + self.post_attention_layernorm(self.self_attn(h, positions, rope, meta, kv))[0]
        return h, self.post_feedforward_layernorm(self.mlp(h, meta))[0]
