"""On a CUDA device: router replay in the training engine with compiled layers, packed rows and bf16 (one rank,
autocast; and one-rank FSDP2), and a LoRA update on the routed experts."""

from __future__ import annotations

import pytest
import torch
from train_helpers import model_cfg, optim_cfg

from hybridflow.config.model_schema import LoraConfig
from hybridflow.controller.runtime import ensure_single_process_group
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.model import decoder_layers
from hybridflow.engine.train.router_replay import RouterHooks

pytestmark = pytest.mark.gpu


def loss_fn(out, mb, ctx):
    return -(out["log_probs"] * mb["response_mask"]).sum() / ctx.global_tokens, {}


def moe_batch(rows: int = 4, prompt: int = 6, response: int = 5, layers: int = 2, k: int = 2, experts: int = 8):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 250, (rows, prompt + response), generator=gen)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded prompt
    routes = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows * (prompt + response)
                                                                                    * layers)])
    routes = routes.view(rows, prompt + response, layers, k).to(torch.int16)
    routes[mask == 0] = -1
    routes[:, -1] = -1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": torch.ones(rows, response), "rollout_routes": routes}


@pytest.mark.parametrize("fsdp", [False, True])
def test_compiled_packed_replay_uses_the_recorded_experts(tiny_model_factory, fsdp):
    path = tiny_model_factory("qwen3_moe", experts=8, experts_per_token=2)
    if fsdp:
        torch.cuda.set_device(0)
        ensure_single_process_group("cuda")
    engine = TrainEngine(model_cfg(path, dtype="auto", compile=True), optim_cfg(), head="lm",
                         router=RouterHooks.Config(replay=True, aux_loss_coef=0.01))
    used = []

    @torch.compiler.disable
    def grab(module, args, out):
        used.append(out[2].detach().cpu())

    for layer in decoder_layers(engine.model):
        layer.mlp.gate.register_forward_hook(grab)
    batch = moe_batch()
    metrics = engine.train_step(batch, loss_fn)
    flat = batch["rollout_routes"][batch["attention_mask"].bool()]
    has = flat[:, 0, 0] >= 0
    for plane in range(2):
        assert torch.equal(used[plane][has], flat[has, plane].long())
    assert metrics["router/aux_loss"] > 0 and engine.router_metrics()["router/agreement"] == 1.0


def test_lora_on_the_experts_trains_in_bf16(tiny_model_factory):
    path = tiny_model_factory("qwen3_moe", experts=8, experts_per_token=2)
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=[], init="gaussian",
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    engine = TrainEngine(model_cfg(path, dtype="auto"), optim_cfg(lora=lora), head="lm")
    metrics = engine.train_step(moe_batch(), loss_fn)
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
