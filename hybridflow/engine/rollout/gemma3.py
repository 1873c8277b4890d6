"""Gemma 3's decoder layer and scaled embedding (`gemma3_text`, HF's `Gemma3ForCausalLM`).

Gemma 3 normalises both sides of each block (HF's `Gemma3DecoderLayer`):

    h = h + post_attention_layernorm(attn(input_layernorm(h)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Its other differences are `model`'s pieces configured for it: RMSNorms that scale by (1 + weight) in fp32
(`model.family_norm`, `kernels.add_rms_norm`'s `plus_one`), per-head q/k norms of that kind, scores scaled by
`query_pre_attn_scalar ** -0.5`, a GELU-tanh gated MLP (`hidden_activation`), sliding-window layers
(`scope.layer_window`) rotated by the local table and global layers by the global one (`rope.rope_columns`), and
the final logits soft-capped by `final_logit_softcapping` where the config sets it (`model.CausalLM.forward`). The
embedding is scaled by sqrt(hidden_size) rounded to the weights' dtype, as transformers' is. The layer keeps
`DecoderLayer`'s protocol, (h, pending output): the input norm adds the previous layer's output, the final norm the
last layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.mlp import MLP
from hybridflow.engine.rollout.model import Attention, family_norm


class ScaledEmbedding(nn.Embedding):
    """The token embedding times sqrt(embedding_dim), the factor rounded to the weight's dtype first (HF's
    `Gemma3TextScaledWordEmbedding`: sqrt(2560) = 50.596 is 50.5 in bf16)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype).item()
        return super().forward(input_ids) * scale


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, backend: str, moe_kernel: str = "grouped_mm") -> None:
        super().__init__()
        exact = backend == "exact"
        self.input_layernorm = family_norm(config.hidden_size, config, exact)
        self.self_attn = Attention(config, layer_index, backend)
        self.post_attention_layernorm = family_norm(config.hidden_size, config, exact)
        self.pre_feedforward_layernorm = family_norm(config.hidden_size, config, exact)
        self.mlp = MLP(config, exact)
        self.post_feedforward_layernorm = family_norm(config.hidden_size, config, exact)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor | None, rope,
                meta: AttnMeta, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's pending output delta -> (h, this layer's output)."""
        x, h = self.input_layernorm(h, delta)
        attended = self.post_attention_layernorm(self.self_attn(x, positions, rope, meta, kv))[0]
        x, h = self.pre_feedforward_layernorm(h, attended)
        return h, self.post_feedforward_layernorm(self.mlp(x, meta))[0]
