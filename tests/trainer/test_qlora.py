"""QLoRA end to end on a tiny model: recipes/grpo_qlora.yaml (`model.quantization=nf4`, LoRA r32) trains 2 GRPO
steps with its base in 4 bits; the adapter export loads in peft over the base; the merged export is the NF4-rounded
base plus the adapters (to 1e-3), not the unquantized base plus them. And the small-card keys' refusals before any
model loads: nf4 without LoRA, a cap below the weights, a cap above the card; a capped plan end to end, its
offload choices reaching the workers. And the FP8 rollout of a 4-bit base: a sync's FP8 rows made from the
dequantized base plus the adapters, one weight at a time; under a cap it follows and trains 2 steps."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.config.loader import load_config
from hybridflow.config.model_schema import LoraConfig
from hybridflow.config.validate import ConfigError, validate
from hybridflow.controller.errors import WorkerError
from hybridflow.engine.budget import DoesNotFit, planning
from hybridflow.engine.train import engine as engine_module
from rl_helpers import reward_file, run

GIB = 2**30
RECIPE = "recipes/grpo_qlora.yaml"


@pytest.fixture
def simulated_gpu(monkeypatch):
    """Plans are made for the CPU device as for a GPU with `free` of `total` bytes."""
    monkeypatch.setattr(planning, "_PLANS", {})

    def use(free: float, total: float) -> None:
        monkeypatch.setattr(planning, "device_memory", lambda device: (int(free), int(total)))

    return use


def test_qlora_recipe_trains_two_steps_and_exports(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from hybridflow.checkpoint.export import export_hf
    from hybridflow.engine.train.quantized_base import dense, quantized_params, to_nf4

    stored = []
    quantize = engine_module.quantize_base
    monkeypatch.setattr(engine_module, "quantize_base", lambda *args: stored.append(quantize(*args)) or stored[-1])
    # lr 1e-2: the adapters move enough in 2 steps that a merge without them would differ
    rows = run(tiny_qwen2, data_dir, tmp_path / "run", f"reward.function={reward_file(tmp_path)}", "actor.lr=1e-2",
               "trainer.val_every=0", "trainer.val_before_train=false", recipe=RECIPE)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in steps)
    # the KL loss's reference: the 4-bit base under disabled adapters (grpo.yaml's actor.kl_loss_coef 0.001)
    assert all(math.isfinite(r["actor/kl_loss"]) for r in steps) and steps[-1]["actor/kl_loss"] != 0
    assert stored == [quantized_params(AutoConfig.from_pretrained(tiny_qwen2), LoraConfig(rank=32))[0]]

    adapter_dir = export_hf(tmp_path / "run", tmp_path / "adapter")
    merged_dir = export_hf(tmp_path / "run", tmp_path / "merged", merge=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        policy = peft.PeftModel.from_pretrained(base, adapter_dir)(ids).logits
    assert torch.isfinite(policy).all()

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    adapters = load_file(adapter_dir / "adapter_model.safetensors")
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        a = adapters[f"base_model.model.{module}.lora_A.weight"]
        b = adapters[f"base_model.model.{module}.lora_B.weight"]
        delta = (32 / 32) * b @ a  # grpo_lora.yaml: alpha 32, rank 32
        weight = base[f"{module}.weight"]
        expected = dense(to_nf4(weight, module)) + delta
        assert torch.allclose(merged[f"{module}.weight"], expected, atol=1e-3)
        assert (merged[f"{module}.weight"] - (weight + delta)).abs().max() > 3e-3  # the 4-bit rounding is in it
        assert delta.abs().max() > 1e-3  # and the trained adapters


def test_nf4_needs_lora_and_is_refused_without_it():
    cfg = load_config(["model.quantization=nf4"], "recipes/grpo.yaml")
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False)
    assert "model.quantization=nf4 stores the frozen base of a LoRA model in 4 bits; it needs actor.lora.rank > 0 " \
           "(got 0)" in str(err.value)
    offloaded = load_config(["actor.param_offload=true"], RECIPE)
    with pytest.raises(ConfigError, match="set actor.param_offload=false"):
        validate(offloaded, check_paths=False)


def test_a_cap_below_the_weights_is_refused_before_any_worker_starts(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the cap was refused")

    monkeypatch.setattr(engine_module, "load_model", no_loading)
    with pytest.raises(DoesNotFit, match=r"trainer.device_memory_gib=0.0001 is below the weights' own size: actor"):
        run(tiny_qwen2, data_dir, tmp_path, "trainer.device_memory_gib=0.0001")
    with pytest.raises(ConfigError, match=r"trainer.device_memory_gib=-1.0 must be > 0"):
        run(tiny_qwen2, data_dir, tmp_path, "trainer.device_memory_gib=-1")


def test_a_capped_run_plans_within_the_cap_and_refuses_one_above_the_card(tiny_qwen2, data_dir, tmp_path,
                                                                            simulated_gpu, capsys):
    simulated_gpu(free=80 * GIB, total=80 * GIB)
    with pytest.raises(WorkerError, match=r"trainer.device_memory_gib=100 is above this card's 80.0 GiB"):
        run(tiny_qwen2, data_dir, tmp_path / "above", "trainer.device_memory_gib=100")
    rows = run(tiny_qwen2, data_dir, tmp_path / "capped", "trainer.device_memory_gib=12", "trainer.val_every=0",
               "trainer.val_before_train=false")
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    resolved = (tmp_path / "capped" / "resolved_config.yaml").read_text()
    # the cap less the 1 GiB the CUDA context and libraries hold outside the allocator (cap.OUTSIDE_ALLOCATOR_BYTES)
    assert resolved.startswith("# device plan of actor: device budget 11.0 GiB of 80.0 GiB")
    cfg = load_config([], tmp_path / "capped" / "resolved_config.yaml")
    assert cfg.trainer.device_memory_gib == 12 and cfg.actor.optimizer == "adamw"


def test_the_plans_offload_choices_reach_the_workers_and_the_resolved_config(tiny_qwen2, data_dir, tmp_path,
                                                                            simulated_gpu, monkeypatch):
    """Where the plan chooses the offloads left to it (here: made to, as a too-small card would make it), the actor
    offloads its optimizer state, the rollout its weights, and `resolved_config.yaml` says so (the choice itself is
    tests/engine/test_small_card_plans.py's)."""
    from dataclasses import replace

    simulated_gpu(free=80 * GIB, total=80 * GIB)
    choices = planning.silent_choices
    monkeypatch.setattr(planning, "silent_choices", lambda demand: [
        replace(d, rollout=replace(d.rollout, offload_weights=True),
                trained=tuple(replace(r, optimizer_offload=True) for r in d.trained)) for d in choices(demand)][:1])
    rows = run(tiny_qwen2, data_dir, tmp_path, "trainer.device_memory_gib=12", "trainer.val_every=0",
               "trainer.val_before_train=false")
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    cfg = load_config([], tmp_path / "resolved_config.yaml")
    assert cfg.rollout.offload_weights is True and cfg.actor.optimizer_offload is True
    assert "rollout weights offloaded while training" in (tmp_path / "resolved_config.yaml").read_text()


def test_a_sync_writes_fp8_rollout_weights_made_from_the_4_bit_base_plus_the_adapters(tiny_qwen2):
    """`model.quantization=nf4` with `rollout.quantization=fp8`: each adapted weight is dequantized, its adapters'
    B·A added and the sum quantized into the FP8 engine's rows in place, one weight at a time (at most the previous
    merged weight is alive when the next is made: never a bf16 copy of the whole model)."""
    import weakref

    pytest.importorskip("torchao")
    from hybridflow.config.model_schema import ModelConfig, OptimConfig
    from hybridflow.engine.rollout import RolloutEngine
    from hybridflow.engine.rollout.fp8 import FP8, quantize_rows
    from hybridflow.engine.rollout.model import weight_target
    from hybridflow.engine.train import TrainEngine
    from hybridflow.engine.train.lora import ADAPTER, merge
    from hybridflow.engine.train.quantized_base import dense, is_nf4

    train = TrainEngine(ModelConfig(path=str(tiny_qwen2), quantization="nf4"), OptimConfig(lora=LoraConfig(rank=8)),
                        head="lm")
    with torch.no_grad():  # B off 0, as after training: the sync carries the adapters
        for layer in train.adapters.layers.values():
            layer.lora_B[ADAPTER].weight.normal_(std=0.05)
    rollout = RolloutEngine.from_pretrained(tiny_qwen2, quantization="fp8", max_num_seqs=4)
    dtype = train.precision.param
    seen: list[weakref.ref] = []

    def watched():
        for name, merged in train.rollout_weights(dtype):
            # the loader's loop variable holds the previous weight until it takes this one; none before it lives
            assert sum(ref() is not None for ref in seen) <= 1, f"merged weights outlived their load (at {name})"
            seen.append(weakref.ref(merged))
            yield name, merged

    assert rollout.load_weights(watched()) == len(train.adapters.layers)
    for name, layer in train.adapters.layers.items():
        base = layer.base_layer.weight
        assert is_nf4(base)
        want = merge(dense(base), layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                     layer.scaling[ADAPTER], dtype)
        q, scale = torch.empty(want.shape, dtype=FP8), torch.empty(want.shape[0])
        quantize_rows(want, q, scale)
        target, shard = weight_target(f"{name}.weight")
        module = rollout.model.get_submodule(target.rsplit(".", 1)[0])
        start, size = module.offsets[shard] if shard is not None else (0, module.weight.shape[0])
        assert torch.equal(module.weight.data[start:start + size].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(module.weight_scale.data[start:start + size], scale), name
        exact = dense(base).float() + layer.scaling[ADAPTER] * layer.lora_B[ADAPTER].weight @ layer.lora_A[ADAPTER].weight
        got = module.weight.data[start:start + size].float() * scale[:, None]
        assert ((got - exact).abs() <= exact.abs() * 2**-4 + scale[:, None] * 2**-10 + 1e-6).all(), name  # e4m3


def test_a_4_bit_base_under_a_cap_rolls_out_in_fp8_and_trains_two_steps(tiny_qwen2, data_dir, tmp_path,
                                                                         simulated_gpu, monkeypatch):
    """With `model.quantization=nf4` and `trainer.device_memory_gib` set, `rollout.quantization` follows to fp8 where
    the FP8 rollout can run (the CPU refusal lifted here, as in test_fp8_start.py; the plan made as for a GPU):
    2 GRPO steps sample from FP8 weights synced from the 4-bit base and the adapters, `token_tis` weighs the
    mismatch, and `resolved_config.yaml` says what followed and why. On the CPU as it is, or without a cap, nothing
    follows."""
    pytest.importorskip("torchao")
    from hybridflow.config import fp8_checks

    keys = ["model.path=unused", "trainer.device_memory_gib=12"]
    assert load_config(keys, RECIPE).rollout.quantization == "none"  # the CPU: FP8 cannot run here
    monkeypatch.setattr(fp8_checks, "_device_problems", lambda trainer: [])
    assert load_config(keys[:1], RECIPE).rollout.quantization == "none"  # no cap: the bf16 copy stays
    assert load_config([*keys, "rollout.quantization=none"], RECIPE).rollout.quantization == "none"  # set: kept
    simulated_gpu(free=80 * GIB, total=80 * GIB)
    rows = run(tiny_qwen2, data_dir, tmp_path, "trainer.device_memory_gib=12", "trainer.val_every=0",
               "trainer.val_before_train=false", "actor.lr=1e-2", f"reward.function={reward_file(tmp_path)}",
               recipe=RECIPE)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:  # FP8 rounding, not a missed sync (the trainer's 4-bit base against the directory's weights)
        assert 1e-3 < row["rollout_corr/max_abs_logp_diff"] < 0.1, row["rollout_corr/max_abs_logp_diff"]
        assert 0.9 < row["rollout_corr/rollout_is_mean"] < 1.1 and row["actor/grad_norm"] > 0
    resolved = (tmp_path / "resolved_config.yaml").read_text()
    assert "rollout.quantization=fp8: model.quantization=nf4 under trainer.device_memory_gib=12" in resolved
    assert "actor.rollout_correction.mode=token_tis: rollout.quantization=fp8" in resolved
    cfg = load_config([], tmp_path / "resolved_config.yaml")
    assert cfg.rollout.quantization == "fp8" and cfg.actor.rollout_correction.mode == "token_tis"
