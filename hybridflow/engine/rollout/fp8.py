"""FP8 rollout weights (`rollout.quantization=fp8`, docs/rollout.md#fp8-rollout): the decoder layers' linear weights
kept as float8 e4m3 with one fp32 scale per output row, requantized in place at every weight load, and the GEMM
that reads them.

- `quantize_rows(x, q, scale)`: each row of x [R, K] scaled so its absolute max maps to 448 (e4m3's largest
  finite value) and rounded to e4m3 into q [R, K], its scale (absmax / 448) into scale [R]. One Triton kernel
  on CUDA (a program per row, two passes over it: the max, then the scaled store); torch elsewhere.
- `fp8_linear(x, weight, weight_scale, bias)`: y = (x quantized per token) @ weight.T, rescaled by the token's
  and the weight row's scales (`torch._scaled_mm` with row-wise scales: cuBLASLt / CUTLASS FP8 on CUDA, the
  reference in fp32 on the CPU), + bias, in x's dtype.
- `Fp8Linear`: a `model.Linear` / `FusedLinear` whose weight is such an FP8 buffer and scale. Its
  `weight_loader` quantizes each incoming (shard of a) weight into its rows in place: the buffers are never
  re-allocated, so captured CUDA graphs stay valid, and a fused shard's rows are quantized alone (per-row
  scales make that exact).
- `quantize_layers(model)` swaps a (meta) `CausalLM`'s decoder-layer projections for `Fp8Linear`s; the
  embeddings, the LM head and the norms stay in the model dtype (the head computes the log-probs the trainer
  compares with). `model_problems(config)` / `device_problems(device, dtype)` say why a model or a device
  cannot run it.

On the CPU this runs torch's own `_scaled_mm` (fp32 out): the tests' way of running the FP8 arithmetic with the
engine's modules; `hybridflow train` refuses FP8 there (`hybridflow.config.fp8_checks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridflow.engine.rollout import kernels
from hybridflow.engine.rollout.linear import FusedLinear, Linear, default_weight_loader
from hybridflow.engine.rollout.model import HYBRID_ARCHITECTURES, CausalLM
from hybridflow.utils.moe_spec import moe_spec

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores, row-wise scaled `_scaled_mm` (torch >= 2.7 on sm_89)
TILE = 4096  # elements of a row the quantize kernel holds at a time


def model_problems(config: Any) -> list[str]:
    """Why the FP8 rollout cannot run the model of Hugging Face `config` ([] when it can)."""
    out = []
    if moe_spec(config) is not None:
        out.append(f"model_type {config.model_type!r} is a mixture of experts: its experts' grouped GEMMs have no "
                   f"FP8 path (dense Llama / Qwen2 / Qwen3 / Mistral only)")
    if config.model_type in HYBRID_ARCHITECTURES:
        out.append(f"model_type {config.model_type!r} mixes linear-attention layers in, whose projections have no FP8 "
                   f"path (dense Llama / Qwen2 / Qwen3 / Mistral only)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads x head_dim": config.num_attention_heads * head_dim,
             "num_key_value_heads x head_dim": kv_heads * head_dim}
    odd = {key: value for key, value in sizes.items() if value % 16}
    if odd:
        out.append(f"{odd}: FP8 GEMMs take dimensions that are multiples of 16")
    return out


def device_problems(device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """Why the FP8 rollout cannot run on `device` with the model in `dtype` (None: not known yet)."""
    if device.type == "cpu":
        return []
    if device.type != "cuda":
        return [f"device {device.type!r}: FP8 runs on CUDA (and on the CPU for tests)"]
    out = []
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        out.append(f"the GPU is sm_{capability[0]}{capability[1]}: FP8 GEMMs need sm_89 or newer (Ada, Hopper)")
    if dtype is not None and dtype != torch.bfloat16:
        out.append(f"dtype {dtype}: the row-wise scaled FP8 GEMM writes bf16 on CUDA")
    return out


def quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """x [R, K] -> q [R, K] e4m3 and scale [R] fp32 in place, with x[r] ~= q[r] * scale[r] (an all-zero row
    gets a tiny scale and zeros)."""
    if kernels.use_triton(x) and x.stride(-1) == 1 and q.stride(-1) == 1:
        rows, width = x.shape
        _quantize_rows_kernel[(rows,)](x, q, scale, width, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                       BLOCK=min(TILE, triton.next_power_of_2(width)), num_warps=8)
        return
    x32 = x.float()
    row_scale = x32.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q.copy_((x32 / row_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    scale.copy_(row_scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (model dtype) @ weight [N, K] (e4m3, scales weight_scale [N]).T + bias -> [T, N] in x's dtype,
    each token quantized with a scale of its own."""
    x = x.contiguous()
    xq = torch.empty(x.shape, dtype=FP8, device=x.device)
    x_scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    quantize_rows(x, xq, x_scale.view(-1))
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


class Fp8Linear(nn.Module):
    """A projection (plain or fused) whose weight is e4m3 [N, K] with per-row scales `weight_scale` [N] fp32;
    the bias stays in the model dtype. Built from the `Linear` it replaces (on the meta device)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.offsets: dict[str, tuple[int, int]] | None = linear.offsets if isinstance(linear, FusedLinear) else None
        rows, _ = linear.weight.shape
        self.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=FP8, device=linear.weight.device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(rows, dtype=torch.float32, device=linear.weight.device),
                                         requires_grad=False)
        self.bias = linear.bias

    def shard_ids(self, leaf: str) -> list[Any]:
        """The pieces a full load of `leaf` consists of: a fused projection's shards; none for the scales, which
        the weight's load writes."""
        if leaf == "weight_scale":
            return []
        return list(self.offsets) if self.offsets is not None else [None]

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None = None) -> None:
        start, size = 0, param.shape[0]
        if self.offsets is not None and shard is not None:  # None: the whole fused weight (Phi-3's checkpoints)
            if shard not in self.offsets:
                raise ValueError(f"fused parameter needs a shard id among {list(self.offsets)}, got {shard!r}")
            start, size = self.offsets[shard]
        if param is not self.weight:
            if param is self.weight_scale:
                raise ValueError("FP8 scales are computed when the weight loads; they are not loaded")
            default_weight_loader(param.data[start:start + size], tensor)
            return
        rows = self.weight.data[start:start + size]
        if tuple(tensor.shape) != tuple(rows.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} does not match the parameter's {tuple(rows.shape)}")
        quantize_rows(tensor.to(rows.device), rows, self.weight_scale.data[start:start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def quantize_layers(model: CausalLM) -> None:
    """Swap every decoder layer's q/k/v, o, gate/up and down projections for an `Fp8Linear` (before the
    weights are allocated: `CausalLM.build`)."""
    for layer in model.model.layers:
        for owner in (layer.get_submodule("self_attn"), layer.get_submodule("mlp")):
            for name, child in list(owner.named_children()):
                if isinstance(child, Linear):
                    setattr(owner, name, Fp8Linear(child))


if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, width, stride_x, stride_q, FP8_MAX: tl.constexpr,
                              BLOCK: tl.constexpr):
        """One program per row: its absolute max over tiles of BLOCK, then each tile scaled, clamped and
        rounded to e4m3 (the second read mostly from L2)."""
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(x))
        scale = tl.maximum(tl.max(peak, axis=0), 1e-12) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        q_row = q_ptr + row.to(tl.int64) * stride_q
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < width)
