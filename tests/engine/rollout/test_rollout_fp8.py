"""The FP8 rollout (`quantization="fp8"`, `fp8.py`) on the CPU, where torch's own `_scaled_mm` runs the FP8
arithmetic: rows quantized within e4m3's rounding, the FP8 linear equal to its dequantized arithmetic, a weight
load that requantizes in place (same buffers, same engine as one built from the new weights), generations close
to full precision, and the engine's refusals (exact mode, the transformers fallback, an unknown value)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.checkpoint_files import checkpoint_tensors
from hybridflow.engine.rollout.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_rows
from hybridflow.engine.rollout.linear import Linear

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21]]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fp8(path, **kwargs):
    return RolloutEngine.from_pretrained(path, quantization="fp8", max_num_seqs=8, **kwargs)


def test_rows_are_quantized_within_e4m3_rounding():
    x = _randn(6, 80) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.5, 0.0])[:, None]  # the last row all zeros
    q, scale = torch.empty(x.shape, dtype=FP8), torch.empty(6)
    quantize_rows(x, q, scale)
    torch.testing.assert_close(scale[:5], x[:5].abs().amax(dim=1) / FP8_MAX)
    err = (q.float() * scale[:, None] - x).abs()
    # 3 mantissa bits: half a step is 2^-4 of the value for normals; below 2^-6 (x scale) steps are 2^-9 apart
    assert (err <= x.abs() * 2**-4 + scale[:, None] * 2**-10).all()
    assert q[:5].float().abs().amax(dim=1).eq(FP8_MAX).all() and not q[5].float().any()


def test_the_fp8_linear_is_its_dequantized_arithmetic():
    weight, bias, x = _randn(48, 64, seed=1), _randn(48, seed=2), _randn(5, 64, seed=3)
    layer = Fp8Linear(Linear(64, 48, bias=True, exact=False))
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)
    xq, x_scale = torch.empty(x.shape, dtype=FP8), torch.empty(5)
    quantize_rows(x, xq, x_scale)
    want = (xq.float() * x_scale[:, None]) @ (layer.weight.float() * layer.weight_scale[:, None]).T + bias
    got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    exact = F.linear(x, weight, bias)
    assert (got - exact).norm() / exact.norm() < 0.05  # e4m3 keeps ~2 significant digits of each operand
    with pytest.raises(ValueError, match="computed when the weight loads"):
        layer.weight_loader(layer.weight_scale, torch.ones(48))


# phi3: q/k/v and gate/up arrive fused, each quantized whole; gemma3_text: its layers' projections (the norms on both
# sides of each block and the per-head q/k norms stay in the model's dtype)
@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma3_text"])
def test_a_weight_load_requantizes_in_place(spread_model, arch):
    engine, other = _fp8(spread_model(arch)), spread_model(arch, seed=1)
    addresses = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    engine.load_weights(checkpoint_tensors(other))
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == addresses
    fresh = _fp8(other)
    for (name, got), want in zip(engine.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(got.float(), want.float()), name
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=7, stop_token_ids=[])
    for a, b in zip(engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_fp8_samples_score_close_to_full_precision(tiny_qwen2):
    """On a model initialised like a real one (std 0.02): the spread-weight models' logits of tens of nats turn
    e4m3's ~3 % error into whole nats."""
    path = tiny_qwen2
    qkv = _fp8(path).model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3, stop_token_ids=[])
    outs = _fp8(path).generate(PROMPTS, params)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gaps = []
    for prompt, samples in zip(PROMPTS, outs):
        for sample in samples:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
            full = logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            gaps.append((full - torch.tensor(sample.logprobs)).abs())
    gap = torch.cat(gaps)
    assert gap.mean() < 0.02 and gap.max() < 0.1, (gap.mean(), gap.max())


def test_the_engine_refuses_fp8_where_it_cannot_run(spread_model):
    path = spread_model("qwen2")
    with pytest.raises(ValueError, match="exact mode runs the trainer's bf16 arithmetic bit for bit"):
        RolloutEngine.from_pretrained(path, quantization="fp8", exact=True)
    with pytest.raises(ValueError, match="quantization='fp8' needs the fast engine"):
        RolloutEngine.from_pretrained(path, quantization="fp8", engine="hf")
    with pytest.raises(ValueError, match="quantization='int3' is invalid; valid: 'none', 'fp8'"):
        RolloutEngine.from_pretrained(path, quantization="int3")
