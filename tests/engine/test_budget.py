"""Device budgeting: the memory estimate against real models, the plan's choices (token budget, gradient
checkpointing, KV cache), the refusal of a run that cannot fit (naming the model, the estimate and the
keys that would make it fit), LoRA's adapters-only training, and out-of-memory errors turned into explained
ones."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine import budget
from hybridflow.engine.budget import planning
from hybridflow.engine.budget import (DeviceDemand, DoesNotFit, FrozenRole, ModelShape, RolloutRole,
                                      TrainedRole, plan)
from hybridflow.engine.train.lora import trainable_params
from hybridflow.engine.train.optim import OPTIMIZERS
from hybridflow.utils.model_shapes import QWEN_SHAPES, SMOLLM2_135M

GIB = 2**30
H200 = (140 * GIB, 141 * GIB)  # (free, total)


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(AutoConfig.for_model("qwen2", **QWEN_SHAPES[name]))


def grpo_demand(name: str, **actor) -> DeviceDemand:
    """recipes/grpo.yaml on one GPU: actor + colocated rollout, 512 + 512 tokens, 256 sequences."""
    s = shape(name)
    role = TrainedRole("actor", "model", s, compute_bytes=2, master_bytes=actor.pop("master_bytes", 4), **actor)
    return DeviceDemand(trained=(role,), rollout=RolloutRole(s, 2, max_num_seqs=256, max_model_len=1024),
                        longest_sequence=1024)


def test_parameter_count_matches_the_model(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    s = ModelShape.from_config(config)
    assert s.params == sum(p.numel() for p in model.parameters())
    assert s.largest_param == model.get_input_embeddings().weight.numel()
    critic = AutoModelForTokenClassification.from_pretrained(tiny_qwen2, num_labels=1)  # the critic's class
    assert ModelShape.from_config(config, "value").params == sum(p.numel() for p in critic.parameters())
    assert abs(shape("7b").params - 7.62e9) < 0.01e9 and abs(shape("14b").params - 14.77e9) < 0.01e9


def test_the_optimizer_table_covers_every_optimizer():
    assert set(budget.STATE_BYTES) == set(OPTIMIZERS)


def test_activation_estimate_scales_with_tokens_and_checkpointing_keeps_one_layer():
    s = shape("1.5b")
    per_layer = s.layer_activation_bytes(2)
    assert per_layer == 2 * (7 * 1536 + 2 * 256 + 4 * 8960)
    assert s.activation_bytes(2, False) == 28 * per_layer + 2 * 2 * 1536
    assert s.activation_bytes(2, True) == 28 * 2 * 1536 + per_layer + 2 * 2 * 1536


def test_default_plan_bounds_micro_batches_and_keeps_checkpointing_off_where_it_fits():
    p = plan(grpo_demand("3b"), *H200)  # the target: the 3B shape trains with the defaults
    actor = p.roles["actor"]
    assert actor.max_tokens == budget.TARGET_TOKENS and not actor.gradient_checkpointing
    assert actor.peak_bytes <= p.cap_bytes and p.generation_peak_bytes <= p.cap_bytes
    # the KV cache takes what the device budget leaves, at most what 256 slots of 1024 tokens need
    kv_per_seq = 1024 * 2 * 36 * 2 * 128 * 2
    assert p.kv_cache_bytes == 257 * kv_per_seq


def test_the_vision_engines_prefill_counts_its_own_cache_in_the_plan():
    """The vision engine's prefill (a transformers forward) keeps its own K/V of the prompts it prefills until they
    are copied into the slots: the plan's generation workspace counts them, so a capped rollout device's KV cache is
    smaller and generation still peaks under the cap (what the engine then takes:
    `test_the_device_plans_kv_cache_and_prefill_size_the_vision_engine`)."""
    text = RolloutRole(shape("3b"), 2, max_num_seqs=256, max_model_len=1024)
    vision = dataclasses.replace(text, prefill_keeps_cache=True)
    assert vision.workspace_bytes() - text.workspace_bytes() == 16384 * text.kv_bytes_per_token()
    plans = [plan(DeviceDemand(rollout=role, longest_sequence=1024, memory_cap=12 * GIB), *H200)
             for role in (text, vision)]
    assert plans[1].kv_cache_bytes < plans[0].kv_cache_bytes < 256 * text.kv_bytes_per_seq()
    assert all(p.generation_peak_bytes <= p.cap_bytes for p in plans)


def test_host_bound_models_checkpoint_longer_micro_batches_by_default():
    """Under HOST_BOUND_PARAMS recomputation is cheaper than more micro-batches (docs/benchmarks.md): the
    0.5B shape gets checkpointed 32k-token micro-batches, 1.5B the plain 16k ones; explicit settings win."""
    small = plan(grpo_demand("0.5b"), *H200).roles["actor"]
    assert small.gradient_checkpointing and small.max_tokens == budget.CHECKPOINTED_TARGET_TOKENS
    large = plan(grpo_demand("1.5b"), *H200).roles["actor"]
    assert not large.gradient_checkpointing and large.max_tokens == budget.TARGET_TOKENS
    off = plan(grpo_demand("0.5b", gradient_checkpointing=False), *H200).roles["actor"]
    assert not off.gradient_checkpointing and off.max_tokens == budget.TARGET_TOKENS


def test_smaller_layers_get_longer_checkpointed_micro_batches():
    """The host work per micro-batch is per layer, the GPU work per token is the layer's parameters: SmolLM2-135M's
    layers are 4.2x smaller than the 0.5B shape's, so its micro-batches are 4.2x longer, within the cap."""
    smol = ModelShape.from_config(AutoConfig.for_model("llama", **SMOLLM2_135M))
    assert smol.layer_params() == 576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536
    assert smol.host_bound_tokens() == 32768 * 14_909_440 // smol.layer_params() == 138050
    assert shape("0.5b").layer_params() == budget.estimate.REFERENCE_LAYER_PARAMS
    assert shape("0.5b").host_bound_tokens() == budget.CHECKPOINTED_TARGET_TOKENS  # where 32k was measured best
    assert shape("1.5b").host_bound_tokens() == budget.CHECKPOINTED_TARGET_TOKENS  # never shorter
    tiny = ModelShape(params=10**6, layers=2, hidden=64, intermediate=256, kv_dim=32, vocab=512, largest_param=10**5)
    assert tiny.host_bound_tokens() == budget.estimate.MAX_CHECKPOINTED_TOKENS


def test_checkpointing_switches_on_where_activations_would_not_fit():
    p = plan(grpo_demand("7b", optimizer="adamw_8bit"), *H200)
    assert p.roles["actor"].gradient_checkpointing and p.roles["actor"].max_tokens == budget.TARGET_TOKENS
    smaller = plan(grpo_demand("3b"), 75 * GIB, 141 * GIB)  # another process holds half the GPU
    assert smaller.roles["actor"].gradient_checkpointing


def test_a_run_that_cannot_fit_is_refused_naming_the_model_the_estimate_and_the_keys():
    with pytest.raises(DoesNotFit) as err:
        plan(grpo_demand("7b"), *H200)
    msg = str(err.value)
    assert "actor update of 7.62B parameters" in msg and "optimizer state 56.7 GiB" in msg
    assert "trainer.gpu_memory_utilization=0.9" in msg
    assert "it fits with actor.optimizer=adamw_8bit" in msg and "actor.optimizer=adamw_cpu_offload" in msg
    with pytest.raises(DoesNotFit, match="it fits with model.master_dtype=bf16 actor.optimizer=adamw_8bit"):
        plan(grpo_demand("14b"), *H200)
    fixed = plan(grpo_demand("14b", master_bytes=2, optimizer="adamw_8bit"), *H200)
    assert fixed.roles["actor"].gradient_checkpointing
    with pytest.raises(DoesNotFit, match="does not fit even with every memory option"):
        plan(grpo_demand("14b"), 40 * GIB, 141 * GIB)


def test_combined_options_are_suggested_when_no_single_one_fits():
    demand = grpo_demand("7b", gradient_checkpointing=False, max_tokens=16384)
    with pytest.raises(DoesNotFit, match="all memory options together: model.gradient_checkpointing=true"):
        plan(demand, 60 * GIB, 141 * GIB)


def test_generation_needs_room_for_a_sequence_in_the_kv_cache():
    demand = dataclasses.replace(grpo_demand("1.5b"), trained=(), frozen=(
        FrozenRole("actor.ref_param_offload", shape("14b"), 2),))
    with pytest.raises(DoesNotFit, match="generation: the KV cache gets") as err:
        plan(demand, 32 * GIB, 141 * GIB)
    assert "actor.ref_param_offload=true" in str(err.value)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_a_hybrid_models_slot_is_counted_as_its_engine_holds_it(tiny_model_factory, arch):
    """Qwen3.5, Qwen3-Next: K/V for the full-attention layers only, plus each linear layer's conv and recurrent
    states; the plan's bytes per slot equal the rollout engine's own (`hybrid_cache`), where counting every layer's
    K/V did not. Qwen3-Next's experts are counted as a mixture of experts' (its active parameters)."""
    from hybridflow.engine.rollout.hybrid_decoder import hybrid_cache

    config = AutoConfig.from_pretrained(tiny_model_factory(arch))
    shape = ModelShape.from_config(config)
    assert shape.attention_layers == config.layer_types.count("full_attention") < shape.layers
    assert shape.experts == getattr(config, "num_experts", 0)
    role = RolloutRole(shape, compute_bytes=4, max_num_seqs=4, max_model_len=64)
    cache = hybrid_cache(config, 64, 4, None, torch.float32, torch.device("cpu"))
    assert role.kv_bytes_per_seq() == cache.token_bytes * 64 + cache.state_bytes
    every_layer = RolloutRole(dataclasses.replace(shape, attention_layers=None, conv_state=0, recurrent_state=0),
                              compute_bytes=4, max_num_seqs=4, max_model_len=64)
    assert every_layer.kv_bytes_per_seq() == 64 * 2 * shape.layers * shape.kv_dim * 4 != role.kv_bytes_per_seq()


def test_apply_plan_fills_only_what_was_left_to_it():
    p = plan(grpo_demand("7b", optimizer="adamw_8bit"), *H200)
    model = SimpleNamespace(gradient_checkpointing=None, master_dtype="fp32")
    role = SimpleNamespace(max_tokens_per_micro_batch=None, micro_batch_size=None, optimizer="auto",
                           optimizer_offload=None)
    m, r = budget.apply_plan(p, "actor", model, role)
    assert m.gradient_checkpointing is True and r.max_tokens_per_micro_batch == budget.TARGET_TOKENS
    assert r.optimizer == "adamw_8bit" and r.optimizer_offload is False
    assert model.gradient_checkpointing is None and role.optimizer == "auto"  # the caller's sections are left alone
    _, r = budget.apply_plan(p, "actor", model, SimpleNamespace(max_tokens_per_micro_batch=None, micro_batch_size=4,
                                                               optimizer="adamw", optimizer_offload=True))
    assert r.max_tokens_per_micro_batch is None and r.optimizer == "adamw"  # rows were chosen: no token budget
    m, r = budget.apply_plan(None, "actor", model, role)  # no plan (a CPU): off, the whole mini-batch, AdamW
    assert m.gradient_checkpointing is False and r.max_tokens_per_micro_batch is None and r.optimizer == "adamw"
    assert r.optimizer_offload is False
    rollout = SimpleNamespace(offload_weights=None)
    assert budget.apply_rollout_plan(p, rollout).offload_weights is False and rollout.offload_weights is None
    assert budget.apply_rollout_plan(None, SimpleNamespace(offload_weights=True)).offload_weights is True
    bf16 = SimpleNamespace(gradient_checkpointing=None, master_dtype="bf16")
    assert budget.apply_plan(None, "actor", bf16, role)[1].optimizer == "adamw_8bit"  # its stochastic rounding


def test_colocated_roles_share_the_first_plan_made_in_the_process(monkeypatch):
    monkeypatch.setattr(planning, "_PLANS", {})
    calls = []
    monkeypatch.setattr(planning, "device_memory", lambda device: calls.append(device) or H200)
    demand = grpo_demand("1.5b")
    first = budget.plan_for_device(demand, torch.device("cuda", 0))
    assert budget.plan_for_device(demand, torch.device("cuda", 0)) is first  # not re-measured after loading
    assert len(calls) == 1
    assert budget.plan_for_device(demand, torch.device("cuda", 1)) is not first
    assert budget.plan_for_device(None, torch.device("cuda", 0)) is None


def test_out_of_memory_errors_come_out_explained():
    p = plan(grpo_demand("1.5b"), *H200)
    with pytest.raises(budget.DeviceOutOfMemory) as err:
        with budget.reported_oom("actor update", p, "1.54B parameters", budget.memory_keys("actor", "model")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = str(err.value)
    assert msg.startswith("actor update of 1.54B parameters ran out of device memory")
    assert "16,384-token micro-batches" in msg and "actor.max_tokens_per_micro_batch" in msg
    assert "model.gradient_checkpointing=true" in msg and "Tried to allocate 2.00 GiB" in msg
    assert err.value.__suppress_context__  # no second, bare trace


def lora_role(name: str, rank: int = 32) -> TrainedRole:
    """recipes/grpo_lora.yaml's actor: rank-32 adapters on every linear layer of the decoder layers."""
    adapters = trainable_params(AutoConfig.for_model("qwen2", **QWEN_SHAPES[name]),
                                LoraConfig(rank=rank))
    return TrainedRole("actor", "model", shape(name), compute_bytes=2, master_bytes=4, lora_params=adapters)


def test_lora_trains_only_its_adapters_so_14b_grpo_fits_one_h200_with_the_rollout_colocated():
    role = lora_role("14b")
    assert abs(role.lora_params - 137.6e6) < 0.1e6  # 48 layers x 32 x (in + out) of the 7 projections
    p, t = role.shape.params, role.lora_params
    assert role.update_bytes(1) == {"weights": (p - t) * 2 + t * 4, "gradients": t * 4, "optimizer state": t * 8}
    assert "gathered compute-dtype weights" in role.update_bytes(2)  # FSDP2 shards it over several ranks
    demand = DeviceDemand(trained=(role,), rollout=RolloutRole(role.shape, 2, max_num_seqs=256, max_model_len=1024),
                          longest_sequence=1024)
    fitted = plan(demand, *H200)
    assert fitted.kv_cache_bytes > 20 * GIB and fitted.roles["actor"].peak_bytes <= fitted.cap_bytes
    assert role.idle_bytes(1) < 0.3 * grpo_demand("14b").trained[0].idle_bytes(1)


def test_a_lora_actor_holds_no_reference_copy_and_counts_its_adapters(tiny_qwen2):
    from hybridflow.config.loader import load_config
    from hybridflow.config.resolved import resolve_facts
    from hybridflow.trainer.memory import device_demands

    for lora in (0, 4):
        cfg = load_config([f"model.path={tiny_qwen2}", "actor.kl_loss_coef=0.1", f"actor.lora.rank={lora}"])
        demand = device_demands(cfg, resolve_facts(cfg))["actor"]
        assert len(demand.frozen) == (0 if lora else 1)
        per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 256)  # in + out: q, k and v, o, the MLP's
        assert demand.trained[0].lora_params == (2 * lora * per_layer if lora else None)
