"""The training engine's exact forward (`train/exact.py`) is the default forward's maths: log-probs, entropy and
gradients (full model and LoRA adapters) agree with the default engine's to rounding; only the bits of the
forward are the rollout's. Gradient checkpointing's recomputation runs the standard ops. The exact forward
refuses rows that are not packed. The closed-form backward formulas of its elementwise ops, eager and compiled,
give autograd's gradients of the standard expressions."""

from __future__ import annotations

import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch
from transformers import LlamaConfig

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine import invariant
from hybridflow.engine.train import TrainEngine, exact
from hybridflow.engine.train.exact import Gradients

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=[], init="gaussian")


def _forward_and_grads(path, lora, exact_len, checkpointing=False, between=lambda: None):
    engine = TrainEngine(model_cfg(path, gradient_checkpointing=checkpointing), optim_cfg(lora=lora), head="lm",
                         pack_on_cpu=True, exact_len=exact_len, seed=3)
    engine.model.train()
    batch = rl_batch(rows=5, prompt_width=7, response_width=6, seed=1)
    out, _ = engine.forward(batch, temperature=0.8, with_entropy=True)
    mask = batch["response_mask"]
    between()
    ((out["log_probs"] * mask).sum() + 0.1 * (out["entropy"] * mask).sum()).backward()
    grads = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("arch, lora", [("qwen2", None), ("qwen3", None), ("llama", LORA)], ids=["qwen2", "qwen3",
                                                                                                "llama-lora"])
def test_exact_forward_and_gradients_are_the_default_engines(tiny_model_factory, arch, lora):
    path = tiny_model_factory(arch)
    (default, default_grads), (exact, exact_grads) = (_forward_and_grads(path, lora, n) for n in (None, 32))
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(exact[key], default[key], atol=1e-5, rtol=1e-5)
    assert exact_grads.keys() == default_grads.keys() and len(exact_grads) > 0
    for name, grad in default_grads.items():
        torch.testing.assert_close(exact_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpoint_recomputation_runs_the_standard_ops(tiny_qwen2, monkeypatch):
    """The forward of a checkpointed exact engine runs the invariant ops and gives the uncheckpointed one's bits;
    its backward's recomputation calls none of them (the backward rotates back with `invariant.rotary`), and the
    gradients stay the default engine's to rounding."""
    from hybridflow.engine import invariant

    calls: list[str] = []
    for name in ("linear", "rms_norm", "rotary", "silu_mul", "attention"):
        real = getattr(invariant, name)
        monkeypatch.setattr(invariant, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    plain, _ = _forward_and_grads(tiny_qwen2, None, 32)
    calls.clear()
    forward_calls: list[str] = []
    (exact, exact_grads) = _forward_and_grads(tiny_qwen2, None, 32, checkpointing=True,
                                              between=lambda: forward_calls.extend(calls) or calls.clear())
    assert set(forward_calls) == {"linear", "rms_norm", "rotary", "silu_mul", "attention"}
    # the backward, recomputation included, ran no invariant op but the rotation back: one per forward rotation
    assert calls == ["rotary"] * forward_calls.count("rotary")
    assert torch.equal(exact["log_probs"], plain["log_probs"])
    _, default_grads = _forward_and_grads(tiny_qwen2, None, None)
    assert exact_grads.keys() == default_grads.keys()
    for name, grad in default_grads.items():
        torch.testing.assert_close(exact_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_exact_attention_refuses_padded_rows(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(), head="lm", exact_len=32)
    batch = rl_batch(rows=2, prompt_width=4, response_width=3)
    with pytest.raises(ValueError, match="exact mode's attention takes packed rows"):
        engine.forward(batch, pack=False)


def _sharded_exact_step(rank, path):
    """One checkpointed training forward and backward of a bf16 exact engine on fp32 master weights (FSDP2 mixed
    precision); the dtypes of the rope rows every rotary call received, forward and recomputation."""
    from hybridflow.engine.train import exact

    seen, rotary = [], exact.rotary
    exact.rotary = lambda x, cos, sin: seen.append(cos.dtype) or rotary(x, cos, sin)
    engine = TrainEngine(model_cfg(path, dtype="bf16", gradient_checkpointing=True), optim_cfg(), head="lm",
                         exact_len=32)
    assert engine.sharded
    engine.model.train()
    batch = rl_batch(rows=3, prompt_width=5, response_width=4)
    out, _ = engine.forward(batch)
    (out["log_probs"] * batch["response_mask"]).sum().backward()
    return seen


def test_sharded_checkpointed_layers_see_the_rollouts_fp32_rope_rows(tiny_qwen2):
    """FSDP2 leaves the layers' inputs as they are: the rotary gets the rollout's fp32 rows in the forward and
    in gradient checkpointing's recomputation alike (a forward-only cast made torch 2.11's recomputation
    refuse its saved tensors on the H200)."""
    from train_helpers import run_ranks

    seen = run_ranks(1, _sharded_exact_step, tiny_qwen2)[0]
    layers = 2
    assert seen == [torch.float32] * (2 * 2 * layers)  # q and k, per layer, forward and recomputation


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_backward_formulas_are_autograds_gradients_of_the_standard_ops(backend, dtype):
    """RMSNorm over hidden rows and over q heads, SwiGLU and the rotation: each formula's gradients are autograd's
    of the standard expression, to rounding; so is the forward's value."""
    grads = exact.EAGER if backend is None else Gradients(backend)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=gen).to(dtype)
    gate, up = (torch.randn(7, 24, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(16, generator=gen)).to(dtype)
    cos, sin = invariant.rope_table(LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), 7)
    cases = {
        "rms_norm": (lambda a, w: exact.rms_norm(a, w, 1e-6, grads),
                     lambda a, w: w * (a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                                       ).to(a.dtype), (x, weight)),
        "silu_mul": (lambda g, u: exact.silu_mul(g, u, grads), lambda g, u: torch.nn.functional.silu(g) * u,
                     (gate, up)),
        "rotary": (lambda a: exact.rotary(a, cos, sin), lambda a: a * cos.to(a.dtype)[:, None] + torch.cat(
            (-a[..., 8:], a[..., :8]), dim=-1) * sin.to(a.dtype)[:, None], (x,)),
    }
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, (op, standard, inputs) in cases.items():
        grad = torch.randn(op(*inputs).shape, generator=gen).to(dtype)
        got, want = ([t.detach().clone().requires_grad_() for t in inputs] for _ in range(2))
        torch.testing.assert_close(op(*got), standard(*want), **tol, msg=name)
        op(*got).backward(grad)
        standard(*want).backward(grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.grad, w.grad, **tol, msg=name)
