"""What a Hugging Face config says about its mixture-of-experts layers, read in one place for the rollout
engine, the trainer's router replay, the device budget and the FLOPs count.

    spec = moe_spec(config)          # None for a dense model
    spec.num_experts, spec.top_k, spec.expert_intermediate, spec.sparse_layers, spec.norm_topk_prob

Supported architectures (`MOE_ARCHITECTURES`) and how their routers differ:
- Qwen3-MoE and Qwen2-MoE: softmax over all experts in fp32, top-k, renormalised to sum 1 only with
  `norm_topk_prob`, then cast to the router logits' dtype; a layer is sparse unless it is in
  `mlp_only_layers` or off the `decoder_sparse_step` grid (those layers have a dense MLP of
  `intermediate_size`). Qwen2-MoE adds a shared expert (`shared_expert_intermediate_size`) scaled by
  sigmoid(`shared_expert_gate`).
- Qwen3-Next: Qwen3-MoE's router and sparse-layer grid with Qwen2-MoE's gated shared expert (its attention is
  hybrid: `engine.rollout.hybrid_decoder`).
- Mixtral: every layer sparse, top-k always renormalised, the routing weights kept in fp32 (the expert
  outputs are weighted and summed in fp32, then cast back).
- OLMoE: Qwen3-MoE's router (`norm_topk_prob`, false in OLMoE-1B-7B), every layer sparse, experts of
  `intermediate_size`; its attention RMS-normalises the whole q and k projections (not per head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next")


@dataclass(frozen=True)
class MoESpec:
    """num_experts routed experts per sparse layer, top_k of them per token, each a SwiGLU MLP of
    expert_intermediate; sparse_layers: the decoder layers with experts (the others are dense);
    shared_intermediate: the shared expert's width (0: none); weights_in_fp32: the routing weights stay
    fp32 (Mixtral) instead of taking the model dtype (Qwen)."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    dense_intermediate: int
    shared_intermediate: int = 0
    weights_in_fp32: bool = False

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def active_mlp_width(self) -> int:
        """The SwiGLU width one token runs through in a sparse layer: top_k experts plus the shared one."""
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    def expert_params(self, hidden: int) -> int:
        """Weights of one sparse layer's routed experts (gate, up and down of each)."""
        return self.num_experts * 3 * hidden * self.expert_intermediate


def moe_spec(config: Any) -> MoESpec | None:
    """The config's `MoESpec`; None for a dense model and for an architecture outside `MOE_ARCHITECTURES`
    (whose router this code does not know: it runs as any other model, without MoE features)."""
    kind = getattr(config, "model_type", None)
    layers = range(config.num_hidden_layers)
    if kind == "mixtral":
        return MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                       tuple(layers), config.intermediate_size, weights_in_fp32=True)
    if kind == "olmoe":
        return MoESpec(config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                       bool(config.norm_topk_prob), tuple(layers), config.intermediate_size)
    if kind in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        sparse = tuple(i for i in layers if config.num_experts > 0 and i not in dense and (i + 1) % step == 0)
        shared = getattr(config, "shared_expert_intermediate_size", 0) if kind != "qwen3_moe" else 0
        return MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob), sparse, config.intermediate_size, shared)
    return None
