"""Model FLOPs per token from a Hugging Face config, and MFU (model FLOPs utilisation).

Counting convention (as PaLM / verl): a training token costs 6 x (matmul parameters) FLOPs forward and
backward, plus causal attention `6 x layers x heads x head_dim x context` (QK^T and AV, forward and
backward, half the square for causality). Only real (unpadded) tokens are counted. Recomputation
(gradient checkpointing) is not counted: MFU measures useful work. With LoRA the frozen weights get no
gradient: 4 x (matmul parameters) per token (forward and the inputs' gradients), plus 6 x the adapters'.
A mixture of experts counts the experts a token is routed to (top-k, and a shared expert) and its router.
"""

from __future__ import annotations

import torch

from hybridflow.utils.moe_spec import moe_spec

# Dense bf16 peak per device kind; MFU is relative to these.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def matmul_params(config) -> int:
    """Parameters that take part in a matmul per token: attention and MLP projections of every layer (a sparse
    layer: its router, the top-k experts and a shared expert with its gate), plus the output head (the
    embedding lookup is free)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    spec = moe_spec(config)
    if spec is None:
        return layers * (attn + 3 * h * config.intermediate_size) + h * config.vocab_size
    sparse = len(spec.sparse_layers)
    routed = 3 * h * spec.active_mlp_width() + h * spec.num_experts + (h if spec.shared_intermediate else 0)
    mlp = sparse * routed + (layers - sparse) * 3 * h * spec.dense_intermediate
    return layers * attn + mlp + h * config.vocab_size


def train_flops(config, seq_lens: list[int], adapter_params: int | None = None) -> float:
    """Forward + backward FLOPs of one pass over rows of `seq_lens` real tokens each; `adapter_params`: the
    trained parameters of a LoRA model (None: every weight trains). A vision-language model counts its language
    model (its text config): the vision tower's FLOPs are not in the figure."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tokens = sum(seq_lens)
    if adapter_params is None:
        dense = 6 * matmul_params(config) * tokens
    else:
        dense = (4 * matmul_params(config) + 6 * adapter_params) * tokens
    # causal attention per row: 2 matmuls x 2 FLOPs x L^2 / 2 (causal) x 3 (fwd + bwd)
    attn = sum(6 * config.num_hidden_layers * heads * head_dim * n * n for n in seq_lens)
    return float(dense + attn)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of `device`, or None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def mfu(flops: float, seconds: float, device: torch.device, world_size: int = 1) -> float | None:
    """Achieved fraction of peak over `world_size` devices, or None without a known peak."""
    peak = peak_flops(device)
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * world_size)

