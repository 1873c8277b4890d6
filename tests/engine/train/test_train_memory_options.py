"""The training engine's memory options: the optimizers (CPU-offloaded AdamW equals AdamW; 8-bit AdamW
trains), compiled decoder layers equal eager ones, and the precision checks of bf16 master weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch

from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.compile import compile_model, resolve_compile
from hybridflow.engine.train.cpu_adamw import CPUOffloadAdamW
from hybridflow.engine.train.model import resolve_precision


def _loss_fn(out, mb, ctx):
    return -(out["log_probs"] * mb["response_mask"]).sum() / ctx.global_tokens, {}


def _adamw_steps(make, params, grads, lrs):
    opt = make(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lrs[min(step, len(lrs) - 1)])
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return opt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cpu_offloaded_adamw_equals_adamw(device):
    """Pieces smaller than a parameter (stage of 100 elements), the lr schedule, weight decay: the same
    weights and moments as torch's AdamW; the moments live in host memory."""
    torch.manual_seed(0)
    shapes = [(30, 17), (5,), (250,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = [p.clone().to(device).requires_grad_() for p in init]
    ours = [p.clone().to(device).requires_grad_() for p in init]
    grads_dev = [[g.to(device) for g in step] for step in grads]
    _adamw_steps(lambda ps: torch.optim.AdamW(ps, **kwargs), ref, grads_dev, [1.0, 0.5, 0.25])
    opt = _adamw_steps(lambda ps: CPUOffloadAdamW(ps, stage_elements=100, **kwargs), ours, grads_dev,
                       [1.0, 0.5, 0.25])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert all(s["exp_avg"].device.type == "cpu" and float(s["step"]) == 3 for s in opt.state.values())
    resumed = CPUOffloadAdamW(ours, **kwargs)  # a checkpoint's state comes back into host memory
    resumed.load_state_dict(opt.state_dict())
    for a, b in zip(resumed.state.values(), opt.state.values()):
        assert a["exp_avg_sq"].device.type == "cpu" and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_cpu_offloaded_adamw_refuses_low_precision_weights():
    with pytest.raises(ValueError, match="fp32 master weights"):
        CPUOffloadAdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])


def test_engine_optimizers_by_name(tiny_qwen2):
    batch = rl_batch(rows=3, prompt_width=5, response_width=4, seed=8)
    weights = {}
    for name in ("adamw", "adamw_cpu_offload"):
        engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(optimizer=name), head="lm")
        for _ in range(2):
            engine.train_step(batch, _loss_fn)
        weights[name] = [p.detach().clone() for p in engine.model.parameters()]
    for a, b in zip(weights["adamw"], weights["adamw_cpu_offload"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="optimizer 'sgd' is not valid; valid: adamw, adamw_8bit"):
        TrainEngine(model_cfg(tiny_qwen2), optim_cfg(optimizer="sgd"), head="lm")
    with pytest.raises(ValueError, match="use optimizer=adamw_8bit"):
        TrainEngine(model_cfg(tiny_qwen2, dtype="bf16", master_dtype="bf16"), optim_cfg(optimizer="adamw"), head="lm")
    # `auto` where no device plan chose: AdamW, or the 8-bit one for bf16 master weights
    assert type(TrainEngine(model_cfg(tiny_qwen2), optim_cfg(optimizer="auto")).optimizer) is torch.optim.AdamW
    if importlib.util.find_spec("torchao") is not None:
        engine = TrainEngine(model_cfg(tiny_qwen2, dtype="bf16", master_dtype="bf16"), optim_cfg(optimizer="auto"))
        assert type(engine.optimizer).__name__ == "AdamW8bit"


def test_compiled_layers_equal_eager_ones(tiny_qwen2):
    """Forward and backward through compiled decoder layers (with gradient checkpointing, which wraps the
    compiled forward) give the eager results. CPU uses the cheap `aot_eager` backend: this checks the
    wiring (graph capture through HF's layer, hooks left outside, shapes that vary between calls); the
    inductor kernels are checked on a GPU (`test_train_gpu.py`)."""
    engines = []
    for compiled in (False, True):
        engine = TrainEngine(model_cfg(tiny_qwen2, gradient_checkpointing=True), optim_cfg(), head="lm")
        if compiled:
            assert compile_model(engine.model, backend="aot_eager") == 2
        engines.append(engine)
    for seed in (1, 2):  # two batch shapes: the second must not fall back or recompile wrongly
        batch = rl_batch(rows=3 + seed, prompt_width=5, response_width=4 + seed, seed=seed)
        outs = []
        for engine in engines:
            out, _ = engine.forward(batch, temperature=0.7, with_entropy=True)
            (out["log_probs"].sum() + out["entropy"].sum()).backward()
            outs.append((out, [p.grad.clone() for p in engine.model.parameters()]))
            engine.model.zero_grad(set_to_none=True)
        (eager, eager_grads), (comp, comp_grads) = outs
        torch.testing.assert_close(comp["log_probs"], eager["log_probs"], atol=1e-5, rtol=1e-5)
        for a, b in zip(comp_grads, eager_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_compile_defaults_to_cuda_only():
    assert resolve_compile(None, torch.device("cpu")) is False
    assert resolve_compile(None, torch.device("cuda", 0)) is True
    assert resolve_compile(True, torch.device("cpu")) is True


def test_bf16_master_weights_need_a_bf16_compute_dtype():
    p = resolve_precision("bf16", torch.device("cpu"), trainable=True, master_dtype="bf16")
    assert p.param == p.master == torch.bfloat16 and not p.mixed
    with pytest.raises(ValueError, match="model.master_dtype=bf16 is below the compute dtype"):
        resolve_precision("auto", torch.device("cpu"), trainable=True, master_dtype="bf16")
    with pytest.raises(ValueError, match="valid: fp32, bf16"):
        resolve_precision("auto", torch.device("cpu"), master_dtype="fp16")
