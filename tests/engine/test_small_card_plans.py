"""The device plan under `trainer.device_memory_gib` at the real Qwen2.5 shapes (1.5B, 7B), full and LoRA r32, bf16
and NF4 bases (with a bf16 or an FP8 rollout), caps of 6 / 8 / 16 / 24 GiB on an 80 GiB card: what it chooses where the keys are silent
(checkpointing, the micro-batch token budget, the KV cache, 8-bit AdamW for `optimizer=auto`), what it refuses and
the keys its refusals name; the 4-bit weights' bytes; the cap's own refusals and the allocator held to it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.budget import (NF4_BYTES, DeviceDemand, DoesNotFit, ModelShape, RolloutRole, TrainedRole,
                                      check_weights_fit, plan)
from hybridflow.engine.budget import cap as cap_module
from hybridflow.engine.budget.cap import OUTSIDE_ALLOCATOR_BYTES
from hybridflow.engine.train.lora import shareable_params, trainable_params
from hybridflow.engine.train.quantized_base import quantized_params
from hybridflow.utils.model_shapes import QWEN_SHAPES

GIB = 2**30
H100 = (80 * GIB, 80 * GIB)  # (free, total)


def demand(name: str, cap: float, lora: bool = False, nf4: bool = False, master_bytes: int = 4,
           rollout_offload: bool | None = None, fp8: bool = False, **actor) -> DeviceDemand:
    """GRPO 16 x 8 of <= 512 + 512 tokens on one card (the actor, its colocated rollout engine) under a `cap`-GiB
    `trainer.device_memory_gib`, as `trainer.memory.device_demands` builds it; the optimizer, its offload and the
    rollout's weight offload left to the plan unless given; `fp8`: the rollout's projections in FP8."""
    config = AutoConfig.for_model("qwen2", **QWEN_SHAPES[name])
    shape, adapters = ModelShape.from_config(config), LoraConfig(rank=32)
    quantized, largest = quantized_params(config, adapters) if nf4 else (0, 0)
    role = TrainedRole("actor", "model", shape, compute_bytes=2, master_bytes=master_bytes,
                       lora_params=trainable_params(config, adapters) if lora else None, quantized_params=quantized,
                       largest_quantized=largest, **{"optimizer": "auto", "optimizer_offload": None, **actor})
    shared = shareable_params(config, adapters) if lora and not actor.get("param_offload") else 0
    rollout = RolloutRole(shape, 2, max_num_seqs=256, max_model_len=1024, offload_weights=rollout_offload,
                          shared_params=shared, fp8=fp8, min_seqs=8)
    return DeviceDemand(trained=(role,), rollout=rollout, longest_sequence=1024, memory_cap=int(cap * GIB))


def p_demand_kv(d: DeviceDemand) -> int:
    """One cached token's bytes in `d`'s rollout engine."""
    assert d.rollout is not None
    return d.rollout.kv_bytes_per_token()


def test_nf4_weights_take_a_quarter_of_bf16_and_the_cap_is_the_budget():
    bf16, nf4 = demand("7b", 24, lora=True), demand("7b", 24, lora=True, nf4=True)
    quantized = nf4.trained[0].quantized_params
    assert quantized == 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)  # every adapted projection
    saved = bf16.trained[0].weight_bytes(1) - nf4.trained[0].weight_bytes(1)
    assert saved == pytest.approx(quantized * (2 - NF4_BYTES)) and 0.5 < NF4_BYTES < 0.52
    # not gpu_memory_utilization x 80 GiB: the cap, less what the process holds outside the allocator
    assert plan(nf4, *H100).cap_bytes == 24 * GIB - OUTSIDE_ALLOCATOR_BYTES == 23 * GIB


def test_7b_bf16_lora_under_24_gib_recomputes_with_a_smaller_budget_once_the_copies_move_off():
    with pytest.raises(DoesNotFit) as err:  # the trainer's bf16 base and the rollout's own copy: 27 GiB
        plan(demand("7b", 24, lora=True), *H100)
    assert "trainer.device_memory_gib=24 of the card's 80.0 GiB, less 1.0 GiB for the CUDA context" in str(err.value)
    assert "it fits with actor.param_offload=true" in str(err.value)  # the rollout's offload is the plan's own
    p = plan(demand("7b", 24, lora=True, param_offload=True), *H100)
    assert p.rollout_offload
    actor = p.roles["actor"]
    assert actor.gradient_checkpointing and actor.max_tokens == 10926 and actor.optimizer == "adamw"
    assert actor.peak_bytes <= 23 * GIB and p.generation_peak_bytes <= 23 * GIB


def test_7b_nf4_lora_fits_24_gib_alone_but_not_16_beside_the_rollouts_bf16_copy():
    p = plan(demand("7b", 24, lora=True, nf4=True), *H100)
    actor = p.roles["actor"]
    assert actor.gradient_checkpointing and actor.max_tokens == 2240 and actor.optimizer == "adamw"
    per_seq = 1024 * p_demand_kv(demand("7b", 24, lora=True, nf4=True))
    # what is left: 45 of the 256 slots (and the scratch slot), the prefill forwards shrunk to 2,048 tokens for them
    assert p.kv_cache_bytes == 46 * per_seq and p.max_prefill_tokens == 2048
    with pytest.raises(DoesNotFit, match="rollout weights 12.2 GiB"):
        plan(demand("7b", 16, lora=True, nf4=True, rollout_offload=True), *H100)


def test_1_5b_lora_plans_at_8_16_and_24_gib():
    at8 = plan(demand("1.5b", 8, lora=True, nf4=True), *H100)  # the rollout's bf16 copy offloaded while training
    assert at8.rollout_offload and at8.kv_cache_bytes == 34 * 1024 * p_demand_kv(demand("1.5b", 8))  # 33 slots
    at7 = plan(demand("1.5b", 7, lora=True, nf4=True), *H100)  # 2,048-token prefill forwards leave 9 slots
    assert at7.max_prefill_tokens == 2048 and at7.kv_cache_bytes == 10 * 1024 * p_demand_kv(demand("1.5b", 7))
    with pytest.raises(DoesNotFit) as err:  # 6.5 GiB: beside the bf16 copy, no room for a prompt's 8 samples
        plan(demand("1.5b", 6.5, lora=True, nf4=True), *H100)
    msg = str(err.value)
    assert "a prompt's 8 samples (rollout.n) of 1,024 tokens and the scratch slot need 252 MiB" in msg
    assert "rollout weights 2.4 GiB" in msg and "param_offload" not in msg  # nf4 refuses it
    at16 = plan(demand("1.5b", 16, lora=True), *H100).roles["actor"]
    assert at16.gradient_checkpointing and at16.max_tokens == 16384  # recomputation keeps the full budget
    at24 = plan(demand("1.5b", 24, lora=True), *H100).roles["actor"]
    assert not at24.gradient_checkpointing and at24.max_tokens == 5564  # or a smaller budget without it
    with pytest.raises(DoesNotFit) as err:  # 6 GiB: the rollout engine's bf16 copy alone is 2.4 GiB
        plan(demand("1.5b", 6, lora=True, nf4=True, rollout_offload=True), *H100)
    assert "generation: the KV cache gets 0 MiB" in str(err.value) and "trainer.n_workers" in str(err.value)


def test_an_fp8_rollout_of_a_4_bit_base_fits_where_the_bf16_copy_does_not():
    """`rollout.quantization=fp8` (what a 4-bit base under a cap follows to): the rollout's projections in a byte each
    plus a scale per row, half the bf16 copy. 1.5B NF4 fits 8 GiB and 7 GiB again; at 6 GiB generation fits, and the
    update (the 1 GiB context, the 2 GiB allowance for fragmentation and the 1.5 GiB log-prob head chunk leave it
    100 MiB beside AdamW) fits once `optimizer=auto` is the CPU AdamW, which the plan then chooses by itself; 7B NF4
    fits 24 GiB with full 16,384-token micro-batches, and 16 GiB with smaller prefill forwards."""
    bf16, fp8 = demand("1.5b", 8, lora=True, nf4=True), demand("1.5b", 8, lora=True, nf4=True, fp8=True)
    assert fp8.rollout.weight_bytes < 0.51 * bf16.rollout.weight_bytes  # 1.22 GiB against 2.44 GiB
    at8 = plan(fp8, *H100)
    assert at8.roles["actor"].max_tokens == 3918 and not at8.rollout_offload and 0.7 * GIB < at8.kv_cache_bytes
    assert at8.roles["actor"].optimizer == "adamw"  # the CPU AdamW only where nothing cheaper fits
    at7 = plan(demand("1.5b", 7, lora=True, nf4=True, fp8=True), *H100)
    assert at7.rollout_offload and at7.kv_cache_bytes == 42 * 1024 * p_demand_kv(fp8)  # 41 slots
    with pytest.raises(DoesNotFit) as err:  # the optimizer given: 8-bit AdamW on the device does not fit
        plan(demand("1.5b", 6, lora=True, nf4=True, fp8=True, optimizer="adamw_8bit"), *H100)
    msg = str(err.value)  # generation fits (2,048-token prefill forwards); the update names the key that fits it
    assert "100 MiB is left beside weights 1.1 GiB" in msg and "generation" not in msg
    assert "Budget: 5.0 GiB (trainer.device_memory_gib=6 of the card's 80.0 GiB, less 1.0 GiB" in msg
    assert "it fits with actor.optimizer=adamw_cpu_offload" in msg
    at6 = plan(demand("1.5b", 6, lora=True, nf4=True, fp8=True), *H100)  # optimizer=auto: chosen by the plan
    assert at6.roles["actor"].optimizer == "adamw_cpu_offload"
    assert at6.rollout_offload and at6.kv_cache_bytes == 17 * 1024 * p_demand_kv(fp8)  # 16 slots
    at24 = plan(demand("7b", 24, lora=True, nf4=True, fp8=True), *H100)
    assert at24.roles["actor"].max_tokens == 16384 and at24.kv_cache_bytes > 6 * GIB
    at16 = plan(demand("7b", 16, lora=True, nf4=True, fp8=True), *H100)  # 2,048-token prefill forwards: 11 slots
    assert at16.max_prefill_tokens == 2048 and at16.rollout_offload and at16.roles["actor"].max_tokens == 12891
    assert at16.kv_cache_bytes == 12 * 1024 * p_demand_kv(demand("7b", 16, lora=True, fp8=True))


def test_1_5b_full_chooses_8_bit_adamw_then_offloads_then_the_cpu_adamw_where_adamw_would_not_fit():
    assert plan(demand("1.5b", 36), *H100).roles["actor"].optimizer == "adamw"
    for cap in (27, 32):
        p = plan(demand("1.5b", cap), *H100)
        assert p.roles["actor"].optimizer == "adamw_8bit" and not p.rollout_offload
    at24 = plan(demand("1.5b", 24), *H100)
    assert at24.roles["actor"].optimizer == "adamw_8bit" and not at24.roles["actor"].optimizer_offload
    assert at24.rollout_offload and at24.roles["actor"].gradient_checkpointing
    at16 = plan(demand("1.5b", 16, master_bytes=2), *H100).roles["actor"]
    assert at16.optimizer == "adamw_8bit" and at16.gradient_checkpointing and at16.max_tokens == 6125
    at22 = plan(demand("1.5b", 22), *H100).roles["actor"]  # optimizer=auto: the CPU AdamW, chosen last
    assert at22.optimizer == "adamw_cpu_offload" and at22.breakdown["optimizer state"] == 0
    with pytest.raises(DoesNotFit) as err:  # 8-bit AdamW given: the plan names the CPU one and bf16 masters
        plan(demand("1.5b", 22, optimizer="adamw_8bit"), *H100)
    assert "it fits with actor.optimizer=adamw_cpu_offload (or: model.master_dtype=bf16 actor.optimizer=" \
           "adamw_8bit)" in str(err.value)
    explicit = plan(demand("1.5b", 32, optimizer="adamw"), *H100)  # a key the user set is not the plan's to change
    assert explicit.roles["actor"].optimizer == "adamw" and explicit.rollout_offload
    with pytest.raises(DoesNotFit, match="it fits with actor.optimizer=adamw_8bit"):
        plan(demand("1.5b", 26, optimizer="adamw"), *H100)


@pytest.mark.parametrize("cap", [6, 8])
def test_small_caps_refuse_full_training_naming_every_option(cap):
    with pytest.raises(DoesNotFit) as err:
        plan(demand("1.5b", cap), *H100)
    assert f"trainer.device_memory_gib={cap}" in str(err.value) and "or a larger trainer.device_memory_gib" in \
        str(err.value)


def test_a_cap_below_the_weights_is_refused_naming_the_keys():
    check_weights_fit(demand("7b", 7, lora=True, nf4=True))  # 5.3 GiB of weights (4-bit base, bf16 embeddings)
    with pytest.raises(DoesNotFit, match="hold 5.3 GiB per device, beside 1.0 GiB for the CUDA context"):
        check_weights_fit(demand("7b", 6, lora=True, nf4=True))  # and the context outside the allocator
    with pytest.raises(DoesNotFit) as err:
        check_weights_fit(demand("7b", 12))  # fp32 master weights: 28 GiB
    msg = str(err.value)
    assert msg.startswith("trainer.device_memory_gib=12 is below the weights' own size: actor (7.62B parameters")
    assert "28.4 GiB per device" in msg and "model.quantization=nf4" in msg and "\n" not in msg


def test_a_cap_above_the_card_is_refused_and_a_cap_within_it_holds_the_allocator(monkeypatch):
    held = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: held.append((f, d)))
    card = torch.device("cuda", 0)
    assert "above this card's 80.0 GiB" in cap_module.hold_allocator(demand("1.5b", 100), card, 80 * GIB)
    assert not held
    assert cap_module.hold_allocator(demand("1.5b", 20), card, 80 * GIB) is None
    assert held == [(19 / 80, card)]  # the cap less the 1 GiB outside the allocator (the CUDA context)
    assert cap_module.hold_allocator(replace(demand("1.5b", 20), memory_cap=None), card, 80 * GIB) is None
    assert len(held) == 1  # uncapped: the allocator is left alone


def test_running_out_of_the_cap_comes_out_explained_with_the_keys():
    """The allocator held to the cap raises CUDA's out-of-memory error past it; the workers' `reported_oom` names the
    capped plan and the keys, the cap among them."""
    from hybridflow.engine.budget import DeviceOutOfMemory, memory_keys, reported_oom

    p = plan(demand("1.5b", 16, lora=True), *H100)
    with pytest.raises(DeviceOutOfMemory) as err:
        with reported_oom("actor update", p, "1.54B parameters", memory_keys("actor", "model")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 79.19 GiB of which 60.1 GiB is free. Of the allocated memory 15.6 GiB")
    msg = str(err.value)
    assert "ran out of device memory" in msg and "device budget 15.0 GiB of 80.0 GiB" in msg  # 16 less the context
    assert "trainer.device_memory_gib (higher: more memory)" in msg and "Tried to allocate 2.00 GiB" in msg


def test_the_plan_offloads_only_where_the_run_needs_it():
    roomy = plan(demand("1.5b", 16, lora=True), *H100)
    assert not roomy.rollout_offload and not roomy.roles["actor"].optimizer_offload
    full = plan(demand("1.5b", 16, master_bytes=2), *H100)  # bf16 master weights: 8-bit AdamW, then offloads
    assert full.rollout_offload and full.roles["actor"].optimizer == "adamw_8bit"
    assert "rollout weights offloaded while training" in full.describe()
    lora = plan(demand("7b", 24, lora=True, param_offload=True), *H100)
    assert lora.rollout_offload and lora.roles["actor"].gradient_checkpointing
    with pytest.raises(DoesNotFit, match="rollout.offload_weights=true"):  # a key the user set stays set
        plan(demand("7b", 24, lora=True, param_offload=True, rollout_offload=False), *H100)


def test_the_allocator_gets_the_cap_less_the_kv_cache_mapped_outside_it(monkeypatch):
    """The rollout's KV cache lives in CUDA virtual memory, outside PyTorch's allocator: while it is mapped the
    allocator is held to the cap less it, and to the whole cap again once it is freed; an uncapped plan is left
    alone."""
    from types import SimpleNamespace

    from hybridflow.engine.budget import hold_beside
    from hybridflow.workers.rollout_replica import RolloutReplica

    held = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: held.append(f))
    card = torch.device("cuda", 0)
    capped = plan(demand("1.5b", 16, lora=True), *H100)
    capped.held_bytes = 16 * GIB
    replica = RolloutReplica.__new__(RolloutReplica)  # its memory bookkeeping alone, no engine built
    replica.engine = SimpleNamespace(kv=SimpleNamespace(mapped_bytes=4 * GIB), wake=lambda: None,
                                     sleep=lambda offload_weights: None, device=card)
    replica.cfg, replica.awake = SimpleNamespace(offload_weights=False), True
    replica.hold_allocator = lambda outside: hold_beside(capped, card, outside)
    replica.sleep()
    replica.wake()
    replica.sleep()
    assert held == [16 / 80, 12 / 80, 16 / 80]
    hold_beside(plan(replace(demand("1.5b", 16, lora=True), memory_cap=None), *H100), card, 4 * GIB)
    assert len(held) == 3
