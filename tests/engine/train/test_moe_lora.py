"""LoRA on a mixture of experts (tiny random Qwen3-MoE / Qwen2-MoE, CPU fp32): the default adapters (the linear
layers: attention, a shared expert) leave the routed experts frozen; `target_parameters` adapts the stacked expert
weights through peft, refusing names that select nothing; the merged stacked weights a sync sends equal peft's
merge, and once loaded into a rollout engine built from the model directory (per-expert tensors) it samples
with the trainer's log-probs; the budget's count of trained parameters is exact."""

from __future__ import annotations

import pytest
import torch
from train_helpers import model_cfg, optim_cfg
from transformers import AutoConfig

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.lora import ADAPTER, trainable_params

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def lora(**kw) -> LoraConfig:
    return LoraConfig(**{**dict(rank=4, alpha=8.0, dropout=0.0, target_modules=[], target_parameters=[],
                                init="gaussian"), **kw})


@pytest.fixture(scope="module")
def moe_path(tiny_model_factory):
    return tiny_model_factory("qwen3_moe", experts=8, experts_per_token=2)


def test_default_adapters_are_the_linear_layers(tiny_model_factory, moe_path):
    engine = TrainEngine(model_cfg(moe_path), optim_cfg(lora=lora()), head="lm")
    assert sorted({n.rsplit(".", 1)[-1] for n in engine.adapters.layers}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert all(not p.requires_grad for n, p in engine.model.named_parameters() if "experts" in n or "gate" in n)
    shared = TrainEngine(model_cfg(tiny_model_factory("qwen2_moe")), optim_cfg(lora=lora()), head="lm")
    assert {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"} <= \
        {n.rsplit(".", 1)[-1] for n in shared.adapters.layers}


def test_expert_adapters_merge_like_peft_and_sync_into_the_rollout_engine(moe_path):
    engine = TrainEngine(model_cfg(moe_path), optim_cfg(lora=lora(target_parameters=EXPERTS)), head="lm", seed=1)
    wrappers = {n: layer for n, layer in engine.adapters.layers.items() if hasattr(layer, "parameter_name")}
    assert len(wrappers) == 4  # gate_up and down of 2 sparse layers
    with torch.no_grad():  # B = 0 at init: give the adapters an update to merge
        for layer in wrappers.values():
            layer.lora_B[ADAPTER].weight.normal_(0, 0.5)
    merged = dict(engine.adapters.merged_weights())
    for name, layer in wrappers.items():
        hf = name.replace(".base_layer", "") + "." + layer.parameter_name
        expected = layer.get_param() + layer.get_delta_weight(ADAPTER)
        torch.testing.assert_close(merged[hf], expected, atol=1e-5, rtol=1e-5)
    assert [n for n, _ in engine.adapters.merged_shapes()] == list(merged)
    assert "model.layers.0.mlp.experts.gate_up_proj" in merged and "model.layers.1.mlp.experts.down_proj" in merged

    rollout = RolloutEngine.from_pretrained(moe_path, max_num_seqs=4)  # per-expert tensors from the directory
    assert rollout.load_weights(engine.rollout_weights()) == len(merged)
    prompts = [[5, 6, 7, 8], [10, 11, 12], [20, 21]]
    outs = rollout.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=[], seed=0))
    width = max(map(len, prompts))
    rows = []
    for p, (o,) in zip(prompts, outs):
        rows.append(([0] * (width - len(p)) + p + o.token_ids, [0] * (width - len(p)) + [1] * (len(p) + 6)))
    ids, mask = (torch.tensor([r[i] for r in rows]) for i in (0, 1))
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": torch.ones(3, 6),
             "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    trained = engine.infer(batch)["log_probs"]
    torch.testing.assert_close(torch.tensor([o[0].logprobs for o in outs]), trained, atol=1e-4, rtol=0)


def test_target_parameters_are_checked_and_counted(moe_path):
    for bad, why in (("experts.gate", "no parameter has that name"), ("mlp.gate.weight", "not a 3-D expert weight")):
        with pytest.raises(ValueError, match=why) as err:
            TrainEngine(model_cfg(moe_path), optim_cfg(lora=lora(target_parameters=[bad])), head="lm")
        assert "valid: experts.down_proj, experts.gate_up_proj" in str(err.value)
    with pytest.raises(ValueError, match="lora.dropout=0.1 cannot apply to expert weights"):
        TrainEngine(model_cfg(moe_path), optim_cfg(lora=lora(target_parameters=EXPERTS, dropout=0.1)), head="lm")
    cfg = lora(target_parameters=EXPERTS)
    engine = TrainEngine(model_cfg(moe_path), optim_cfg(lora=cfg), head="lm")
    assert trainable_params(AutoConfig.from_pretrained(moe_path), cfg) == engine.trained_params()


def test_the_rollout_engine_holds_a_lora_trainers_frozen_weights(moe_path):
    """A LoRA trainer on one device lends its frozen weights (embeddings, head, norms, routers, unadapted experts)
    to the rollout engine, which holds them as they are: same storage, the same samples as an engine with copies,
    not read from the directory, never loaded into, left in place by an offloading sleep; the device budget's
    count of them is exact."""
    from hybridflow.engine.train.lora import shareable_params

    cfg = lora(target_parameters=["experts.down_proj"])
    engine = TrainEngine(model_cfg(moe_path), optim_cfg(lora=cfg), head="lm")
    shared = engine.frozen_weights()
    assert "model.layers.0.mlp.experts.gate_up_proj" in shared and "model.embed_tokens.weight" in shared
    assert not any("down_proj" in n or "self_attn.q_proj" in n for n in shared)  # adapted, or a linear layer
    assert sum(t.numel() for t in shared.values()) == shareable_params(AutoConfig.from_pretrained(moe_path), cfg)
    holder = RolloutEngine.from_pretrained(moe_path, max_num_seqs=4, shared_weights=shared)
    copies = RolloutEngine.from_pretrained(moe_path, max_num_seqs=4)
    experts = holder.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.data_ptr() == shared["model.layers.1.mlp.experts.gate_up_proj"].data_ptr()
    assert holder.model.model.layers[1].mlp.experts.down_proj.data_ptr() != \
        engine.model.model.layers[1].mlp.experts.base_layer.down_proj.data_ptr()
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    prompts = [[5, 6, 7, 8], [10, 11, 12]]
    assert [o[0].token_ids for o in holder.generate(prompts, params)] == \
        [o[0].token_ids for o in copies.generate(prompts, params)]
    with pytest.raises(ValueError, match="shared with this engine"):
        holder.load_weights([("model.layers.0.mlp.gate.weight", shared["model.layers.0.mlp.gate.weight"])])
    holder.load_weights(engine.rollout_weights())  # the merged adapted weights alone: fine
    holder.sleep(offload_weights=True)
    holder.wake()
    assert experts.gate_up_proj.data_ptr() == shared["model.layers.1.mlp.experts.gate_up_proj"].data_ptr()
    with pytest.raises(RuntimeError, match="needs LoRA on one unsharded rank"):  # full training changes them all
        TrainEngine(model_cfg(moe_path), optim_cfg(), head="lm").frozen_weights()
