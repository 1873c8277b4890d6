"""The fast engine on mixtures of experts (CPU, tiny random Qwen3-MoE / Mixtral / Qwen2-MoE / OLMoE / Qwen3-Next with
spread weights): greedy parity with transformers in fp32 (OLMoE with and without its q/k/v clamp), the recorded routes,
both weight layouts, bf16 log-probs, the experts' kernels."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout import grouped_gemm
from hybridflow.engine.rollout.grouped_gemm import expert_mlp, resolve_kernel
from hybridflow.engine.rollout.kernels import silu_mul

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20] * 17, [40, 41], [7] * 30]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "qwen3_next"]


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_forward(model, ids):
    """(log_softmax of the logits [L, V] fp32, each token's top-k experts [L, sparse layers, k]) of one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    experts = torch.stack([logits.float().softmax(-1).topk(k, -1).indices for logits in out.router_logits], 1)
    return out.logits[0].float().log_softmax(-1), experts


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_routes_match_transformers(spread_model, arch):
    """Tokens equal `generate`'s, log-probs a full forward's, and the recorded routes (prompt and fed response
    tokens) the router's top-k of that forward, with fewer slots than prompts (per-expert checkpoint names)."""
    path = spread_model(arch)
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=3, record_routes=True)
    outs = engine.generate(PROMPTS, GREEDY)
    model = hf_model(path)
    for prompt, (out,) in zip(PROMPTS, outs):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        logp, experts = hf_forward(model, prompt + out.token_ids[:-1])
        picked = logp[len(prompt) - 1:].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), picked, atol=1e-4, rtol=0)
        assert out.routes.dtype == torch.int16 and torch.equal(out.routes.long(), experts)


def test_olmoe_clamping_q_k_and_v_matches_transformers(spread_model, tmp_path):
    """OLMoE's `clip_qkv` clamps the normalised q and k and the v projection: at 0.5, well inside the spread
    model's values, greedy tokens still equal `generate`'s."""
    import json
    import shutil

    path = shutil.copytree(spread_model("olmoe"), tmp_path / "clipped")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "clip_qkv": 0.5}))
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=5)
    model, unclipped = hf_model(path), hf_model(spread_model("olmoe"))
    outs = engine.generate(PROMPTS, GREEDY)
    differs = False
    for prompt, (out,) in zip(PROMPTS, outs):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        differs |= expected != unclipped.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens,
                                                  do_sample=False, eos_token_id=None,
                                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert differs  # the clamp changed what the model says


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_next"])
def test_stacked_and_per_expert_layouts_load_the_same(spread_model, arch):
    """A trainer's state dict (stacked experts, `mlp.experts.gate_up_proj`) builds the engine the checkpoint's
    per-expert tensors do; `load_weights` takes either layout in place, and a bad expert index or shape is
    refused with the name (layer 1: sparse in both; Qwen3-Next's tiny layer 0 is dense)."""
    path = spread_model(arch)
    model = hf_model(path)
    disk = RolloutEngine.from_pretrained(path, max_num_seqs=4)
    stacked = RolloutEngine.from_config(model.config, model.named_parameters(), max_num_seqs=4, stop_token_ids=[])
    assert [o[0].token_ids for o in disk.generate(PROMPTS, GREEDY)] == \
        [o[0].token_ids for o in stacked.generate(PROMPTS, GREEDY)]
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach() * 0.5
    inter = gate_up.shape[1] // 2
    per_expert = [(f"model.layers.1.mlp.experts.{e}.{part}.weight", w) for e in range(gate_up.shape[0])
                  for part, w in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]))]
    assert disk.load_weights(per_expert) == len(per_expert)
    assert stacked.load_weights([("model.layers.1.mlp.experts.gate_up_proj", gate_up)]) == 1
    for engine in (disk, stacked):
        torch.testing.assert_close(engine.model.model.layers[1].mlp.experts.gate_up_proj, gate_up, atol=0, rtol=0)
    with pytest.raises(ValueError, match="experts.9.up_proj.*out of range"):
        disk.load_weights([("model.layers.1.mlp.experts.9.up_proj.weight", gate_up[0, inter:])])
    with pytest.raises(ValueError, match="experts.0.down_proj.*shape"):
        disk.load_weights([("model.layers.1.mlp.experts.0.down_proj.weight", gate_up[0])])


def test_mixtral_hub_names_load(spread_model):
    """Mixtral's hub names (`block_sparse_moe.experts.{e}.w1/w3/w2`, `block_sparse_moe.gate`) map to the
    stacked weights."""
    path = spread_model("mixtral")
    model = hf_model(path)
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=2)
    down = model.model.layers[0].mlp.experts.down_proj.detach()
    router = model.model.layers[0].mlp.gate.weight.detach()
    engine.load_weights([("model.layers.0.block_sparse_moe.experts.2.w2.weight", down[2] * 2),
                         ("model.layers.0.block_sparse_moe.gate.weight", router * 3)])
    block = engine.model.model.layers[0].mlp
    torch.testing.assert_close(block.experts.down_proj[2], down[2] * 2, atol=0, rtol=0)
    torch.testing.assert_close(block.gate.weight, router * 3, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_log_probs_within_tolerance(spread_model, arch):
    """bf16 on the CPU: the engine's greedy log-probs against a bf16 transformers forward of the same tokens
    (the routing weights' dtype differs by architecture: bf16 for Qwen, fp32 for Mixtral). The tolerance is a
    quarter of bf16's own error here (transformers' bf16 forward against its fp32 one), and no less than 5e-3 in
    the mean: CPUs with bf16 matrix units (AMX) round differently and put even dense models' bf16 gap near 1e-2.
    Casting the routing weights to the other dtype doubles the gap (1.4e-2 / 1.6e-2 where this is 0.9e-2 /
    0.4e-2 on such a CPU) and fails it."""
    path = spread_model(arch)
    engine = RolloutEngine.from_pretrained(path, dtype=torch.bfloat16, max_num_seqs=5)
    model, truth = hf_model(path, torch.bfloat16), hf_model(path)
    diffs, bf16_error = [], []
    for prompt, (out,) in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                stop_token_ids=[]))):
        tokens = torch.tensor(out.token_ids)[:, None]
        picked, exact = (hf_forward(m, prompt + out.token_ids[:-1])[0][len(prompt) - 1:].gather(-1, tokens)[:, 0]
                         for m in (model, truth))
        diffs.append((torch.tensor(out.logprobs) - picked).abs())
        bf16_error.append((picked - exact).abs())
    diffs, bf16_error = torch.cat(diffs), torch.cat(bf16_error)
    assert diffs.mean() < max(5e-3, bf16_error.mean() / 4) and diffs.max() < max(5e-2, bf16_error.max() / 4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_routes_of_n_samples_and_decode_windows(spread_model, arch):
    """1 or 8 decode steps per host sync record the same routes (rows stopping inside a window); the n samples
    of a prompt share its prompt's routes (Qwen3-Next: prefilled once, its states copied to the n slots); a dense
    model cannot record."""
    path = spread_model(arch)
    engines = {steps: RolloutEngine.from_pretrained(path, max_num_seqs=6, record_routes=True,
                                                    decode_steps_per_sync=steps) for steps in (1, 8)}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[5, 9, 116])
    one, eight = (engines[steps].generate(PROMPTS, greedy) for steps in (1, 8))
    for (x,), (y,) in zip(one, eight):
        assert x.token_ids == y.token_ids and torch.equal(x.routes, y.routes)
    sampled = engines[8].generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3,
                                                               stop_token_ids=[]))
    for prompt, samples in zip(PROMPTS[:2], sampled):
        for s in samples:
            assert s.routes.shape[0] == len(prompt) + len(s.token_ids) - 1
            assert torch.equal(s.routes[:len(prompt)], samples[0].routes[:len(prompt)])
    with pytest.raises(ValueError, match="record_routes needs a mixture-of-experts"):
        RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=2, record_routes=True)


def test_expert_kernels_agree():
    """The grouped_mm and gather kernels give the same tokens' outputs, equal to a loop over experts."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 11, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            expected[t] += weights[t, j] * (down[e] @ silu_mul((gate_up[e] @ x[t])[None])[0])
    for kernel in ("grouped_mm", "gather"):
        torch.testing.assert_close(expert_mlp(x, weights, ids, gate_up, down, silu_mul, kernel), expected,
                                   atol=1e-4, rtol=1e-4)


def test_auto_kernel_is_the_measured_fastest_where_it_runs(monkeypatch):
    """auto: Triton on a bf16 CUDA device (measured faster, docs/moe.md), grouped_mm where Triton is missing or on
    the CPU, gather for fp32 on CUDA; an explicit Triton request off CUDA is refused."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    monkeypatch.setattr(grouped_gemm, "triton", object())
    assert resolve_kernel("auto", cuda, torch.bfloat16) == "triton"
    assert resolve_kernel("auto", cuda, torch.float32) == "gather"
    assert resolve_kernel("auto", torch.device("cpu"), torch.bfloat16) == "grouped_mm"
    assert resolve_kernel("grouped_mm", cuda, torch.bfloat16) == "grouped_mm"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernel("triton", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(grouped_gemm, "triton", None)
    assert resolve_kernel("auto", cuda, torch.bfloat16) == "grouped_mm"
