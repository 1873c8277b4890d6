"""GPU-only checks of the FP8 rollout (`quantization="fp8"`, skipped on CPU; sm_89+): the Triton quantizer rounds
as torch's cast does, the FP8 linear (cuBLASLt / CUTLASS row-wise `_scaled_mm`, bf16 out) equals its
dequantized arithmetic, CUDA-graph decode equals eager decode, and a weight load requantizes the buffers the
captured graphs read (the next generation equals a fresh engine's on the new weights)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams, kernels
from hybridflow.engine.rollout.checkpoint_files import checkpoint_tensors
from hybridflow.engine.rollout.fp8 import FP8, MIN_CAPABILITY, fp8_linear, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY, reason="needs sm_89+")]

PROMPTS = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14]]  # a bucket's size: the same GEMM shapes


def _quantized(x: torch.Tensor, triton: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(kernels, "use_triton", lambda t: triton)
    q, scale = torch.empty(x.shape, dtype=FP8, device=x.device), torch.empty(x.shape[0], device=x.device)
    quantize_rows(x, q, scale)
    return q.float(), scale


def test_the_quantize_kernel_rounds_as_torch_does(monkeypatch):
    x = torch.randn(7, 5000, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, 7, device="cuda")[:, None]
    want, got = _quantized(x, False, monkeypatch), _quantized(x, True, monkeypatch)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=1e-6)
    assert torch.equal(got[0], want[0])


def test_the_fp8_linear_is_its_dequantized_arithmetic():
    x = torch.randn(256, 1536, device="cuda", dtype=torch.bfloat16)
    weight, bias = torch.randn(2048, 1536, device="cuda") * 0.02, torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    wq, ws = torch.empty(weight.shape, dtype=FP8, device="cuda"), torch.empty(2048, device="cuda")
    quantize_rows(weight, wq, ws)
    xq, xs = torch.empty(x.shape, dtype=FP8, device="cuda"), torch.empty(256, device="cuda")
    quantize_rows(x, xq, xs)
    want = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).T + bias.float()
    got = fp8_linear(x, wq, ws, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bf16 output rounding


def test_fp8_graphs_equal_eager_and_a_weight_load_reaches_them(spread_model):
    path, other = spread_model("qwen2"), spread_model("qwen2", seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    kw = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=8, quantization="fp8")
    graphs = RolloutEngine.from_pretrained(path, **kw)
    eager = RolloutEngine.from_pretrained(path, cuda_graphs=False, **kw)
    assert [o[0].token_ids for o in graphs.generate(PROMPTS, params)] == \
        [o[0].token_ids for o in eager.generate(PROMPTS, params)]
    graphs.load_weights(checkpoint_tensors(other))
    fresh = RolloutEngine.from_pretrained(other, **kw)
    assert [o[0].token_ids for o in graphs.generate(PROMPTS, params)] == \
        [o[0].token_ids for o in fresh.generate(PROMPTS, params)]
