"""Device budgeting and FLOPs of a mixture of experts: every expert counts for memory, the routed ones for a
token's activations and FLOPs; LoRA on the stacked experts costs their merged weights per forward; the
Qwen3-30B-A3B shape's LoRA GRPO plan on one H200."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.budget import DeviceDemand, DoesNotFit, ModelShape, RolloutRole, TrainedRole, plan
from hybridflow.engine.train.flops import matmul_params
from hybridflow.engine.train.lora import adapted_expert_params, shareable_params, trainable_params
from hybridflow.utils.model_shapes import moe_shape_config

GIB = 2**30
H200 = (int(139.8 * GIB), int(139.8 * GIB))  # (free, total) as the device reports it


def lora(**kw) -> LoraConfig:
    return LoraConfig(**{**dict(rank=32, alpha=32.0, dropout=0.0, target_modules=[], target_parameters=[],
                                init="default"), **kw})


def test_30b_a3b_counts_all_experts_for_memory_and_the_routed_ones_for_compute():
    config = moe_shape_config("qwen3-30b-a3b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    s = ModelShape.from_config(config)
    assert s.params == sum(p.numel() for p in model.parameters()) and abs(s.params - 30.53e9) < 0.01e9
    idle = 48 * (128 - 8) * 3 * 2048 * 768
    assert s.compute_params == s.params - idle and abs(s.compute_params - 3.35e9) < 0.01e9
    assert s.intermediate == 8 * 768 and s.layer_activation_bytes(2) == 2 * (7 * 2048 + 2 * 512 + 4 * 6144
                                                                             + 2 * 8 * 2048) + 8 * 128
    attention = 2048 * 4096 * 2 + 2048 * 512 * 2
    routed = 3 * 2048 * 8 * 768 + 2048 * 128
    assert matmul_params(config) == 48 * (attention + routed) + 2048 * 151936
    dense = moe_shape_config("qwen3-dense-a3b")  # the dense model of the same active parameters
    assert abs(matmul_params(dense) - matmul_params(config)) < 0.005 * matmul_params(config)


def test_expert_lora_costs_the_merged_weights_of_each_forward():
    config = moe_shape_config("qwen3-moe-small")
    s = ModelShape.from_config(config)
    cfg = lora(rank=8, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    experts = adapted_expert_params(config, cfg)
    assert experts == 12 * 64 * 3 * 1024 * 256 and adapted_expert_params(config, lora()) == 0
    assert trainable_params(config, cfg) - trainable_params(config, lora(rank=8)) == \
        8 * 64 * 12 * ((1024 + 512) + (256 + 1024))
    role = TrainedRole("actor", "model", s, 2, 4, lora_params=1, expert_lora_params=experts)
    assert role.forward_fixed_bytes(False) == experts * 2 + experts * 2 / 12
    assert role.forward_fixed_bytes(True) == 2 * experts * 2 / 12
    assert role.activation_peak(0, True) - TrainedRole("actor", "model", s, 2, 4).activation_peak(0, True) == \
        role.forward_fixed_bytes(True)


def test_30b_a3b_lora_grpo_plan_on_one_h200():
    """recipes/grpo_lora.yaml's adapters (rank 32 on the linear layers: attention alone in a Qwen3-MoE), GRPO's
    512 + 512 tokens, 256 sequences, the rollout colocated: with the frozen weights lent to the rollout engine
    (embeddings, head, norms, routers, experts: 29.6B) its own copy is the attention's, and the KV cache gets all
    its slots; without lending, both copies leave little for the cache. Adapting every expert too trains 1.3B
    parameters and is refused with the keys that fit it."""
    config = moe_shape_config("qwen3-30b-a3b")
    s = ModelShape.from_config(config)

    def demand(cfg, lend: bool = True):
        role = TrainedRole("actor", "model", s, 2, 4, lora_params=trainable_params(config, cfg),
                           expert_lora_params=adapted_expert_params(config, cfg))
        rollout = RolloutRole(s, 2, max_num_seqs=256, max_model_len=1024,
                              shared_params=shareable_params(config, cfg) if lend else 0)
        return DeviceDemand(trained=(role,), rollout=rollout, longest_sequence=1024)

    assert abs(shareable_params(config, lora()) - 29.63e9) < 0.01e9
    lent, copied = plan(demand(lora()), *H200), plan(demand(lora(), lend=False), *H200)
    assert lent.generation_breakdown["rollout weights"] < 2 * GIB
    assert lent.kv_cache_bytes == 257 * 1024 * 48 * 2 * 512 * 2  # every slot and the scratch one
    assert copied.kv_cache_bytes < lent.kv_cache_bytes / 2 and copied.roles["actor"].gradient_checkpointing
    assert copied.max_prefill_tokens == 2048 and lent.max_prefill_tokens is None  # shrunk only where slots are short
    with pytest.raises(DoesNotFit, match="3.35B active: 8 of 128 experts.*it fits with"):
        plan(demand(lora(target_parameters=["experts.gate_up_proj", "experts.down_proj"])), *H200)


def test_the_run_plans_lent_weights_only_where_the_actor_lends_them(tiny_model_factory, tmp_path):
    from transformers import AutoConfig

    from hybridflow.config.loader import load_config
    from hybridflow.config.resolved import resolve_facts
    from hybridflow.trainer.memory import device_demands
    from hybridflow.trainer.role_configs import actor_config

    path = tiny_model_factory("qwen3_moe", experts=8, experts_per_token=2)

    def lent(*extra):
        cfg = load_config([f"model.path={path}", "actor.lora.rank=4", *extra], "recipes/grpo.yaml")
        facts = resolve_facts(cfg)  # the actor lends exactly where the plan counts it
        assert actor_config(cfg, 1, facts=facts).lend_frozen_weights == facts.lend_frozen_weights
        return device_demands(cfg, facts)["actor"].rollout.shared_params

    expected = shareable_params(AutoConfig.from_pretrained(path), lora(rank=4))
    assert lent() == expected > 0
    assert lent("trainer.n_workers=2") == lent("actor.param_offload=true") == lent("actor.lora.rank=0") == 0
    assert lent("rollout.engine=hf") == 0
