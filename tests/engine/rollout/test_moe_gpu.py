"""GPU-only checks of the mixture-of-experts rollout (skipped on CPU): the Triton grouped GEMM and torch._grouped_mm
equal the gather reference in bf16 over several tiles; CUDA-graph decode equals eager decode with routes
recorded inside the graphs, for both kernels; fp32 greedy equals `transformers.generate`."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.grouped_gemm import expert_mlp
from hybridflow.engine.rollout.kernels import silu_mul

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14]]  # a bucket's size: the same GEMM shapes


@pytest.mark.parametrize("tokens", [1, 37, 256, 2048])
def test_expert_kernels_equal_the_gather_reference_in_bf16(tokens):
    gen = torch.Generator("cuda").manual_seed(0)
    hidden, inter, experts, k = 512, 192, 32, 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).bfloat16()
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(k, -1).indices
    weights = torch.rand(tokens, k, device="cuda", generator=gen).softmax(-1).bfloat16()
    reference = expert_mlp(x.float(), weights.float(), ids, gate_up.float(), down.float(), silu_mul, "gather")
    runs = [("grouped_mm", None)] + [("triton", dict(block_m=m, block_n=n, block_k=64))
                                     for m in (16, 32, 64) for n in (64, 128)]
    for kernel, tiles in runs:
        out = expert_mlp(x, weights, ids, gate_up, down, silu_mul, kernel, tiles).float()
        torch.testing.assert_close(out, reference, atol=3e-2, rtol=3e-2, msg=f"{kernel} {tiles}")


@pytest.mark.parametrize("kernel", ["grouped_mm", "triton"])
def test_graph_decode_records_the_routes_eager_decode_does(spread_model, kernel):
    path = spread_model("qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    runs = [RolloutEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=4,
                                          record_routes=True, moe_kernel=kernel, cuda_graphs=graphs)
            .generate(PROMPTS, params) for graphs in (True, False)]
    for (a,), (b,) in zip(*runs):
        assert a.token_ids == b.token_ids and torch.equal(a.routes, b.routes)


def test_fp32_greedy_equals_transformers(spread_model):
    from transformers import AutoModelForCausalLM

    path = spread_model("mixtral")
    outs = RolloutEngine.from_pretrained(path, device="cuda", max_num_seqs=4).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[]))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    model.config._experts_implementation = "eager"  # transformers' grouped_mm path is for bf16 on CUDA
    for prompt, (out,) in zip(PROMPTS, outs):
        expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
