"""LoRA in the training engine: which modules get adapters (and the errors naming the valid ones), the dtype policy
(frozen weights in the compute dtype, adapters in the master dtype; one process under autocast, two gloo ranks
under FSDP2's bf16 mixed precision), the initial policy equal to the base model, the merged weights a sync sends,
dropout off in log-prob passes, compiled layers through peft's modules (one graph for every layer, a 4-bit base
too), the meta-device count of trained
parameters the device budget uses, and the FLOPs of a frozen-weight update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch, run_ranks
from transformers import AutoConfig

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.compile import compile_model
from hybridflow.engine.train.flops import matmul_params, train_flops
from hybridflow.engine.train.lora import trainable_params

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(rank: int = 4, **kw) -> LoraConfig:
    return LoraConfig(**{**dict(rank=rank, alpha=8.0, dropout=0.0, target_modules=[], init="default"), **kw})


def loss_fn(out, mb, ctx):
    return -(out["log_probs"] * mb["response_mask"]).sum() / ctx.global_tokens, {}


def adapted(engine: TrainEngine) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in engine.adapters.layers})


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_default_targets_are_every_linear_layer_of_the_decoder_layers(tiny_model_factory, arch):
    engine = TrainEngine(model_cfg(tiny_model_factory(arch)), optim_cfg(lora=lora()), head="lm")
    assert adapted(engine) == sorted(ALL)
    assert engine.adapters.peft_config.target_modules == set(ALL)
    frozen = [n for n, p in engine.model.named_parameters() if not p.requires_grad]
    assert "model.embed_tokens.weight" in frozen and all(".lora_" not in n for n in frozen)


def test_target_modules_are_checked_naming_the_valid_ones(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(target_modules=["self_attn.q_proj", "v_proj"])),
                         head="lm")
    assert adapted(engine) == ["q_proj", "v_proj"]
    for bad, why in (("qproj", "no module has that name"), ("embed_tokens", "not a linear layer of a decoder layer"),
                     ("lm_head", "not a linear layer of a decoder layer"), ("mlp", r"mlp \(Qwen2MLP\)")):
        with pytest.raises(ValueError, match=why) as err:
            TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(target_modules=[bad])), head="lm")
        assert "valid: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in str(err.value)
    with pytest.raises(ValueError, match="lora.init='pissa' is not valid; valid: default, gaussian"):
        TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(init="pissa")), head="lm")


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_the_initial_policy_is_the_base_model_and_disabling_the_adapters_gives_it_back(tiny_qwen2, init):
    batch = rl_batch(rows=4, prompt_width=5, response_width=4, seed=1)
    base = TrainEngine(model_cfg(tiny_qwen2), None, head="lm").infer(batch)["log_probs"]
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(init=init)), head="lm")
    a = engine.adapters.layers["model.layers.0.self_attn.q_proj"].lora_A["default"].weight
    assert a.abs().sum() > 0 and (init != "gaussian" or abs(float(a.detach().std()) - 1 / 4) < 0.05)
    assert torch.equal(engine.infer(batch)["log_probs"], base)
    for _ in range(2):
        engine.train_step(batch, loss_fn)
    assert (engine.infer(batch)["log_probs"] - base).abs().max() > 1e-3
    with engine.adapters.disabled():
        assert torch.equal(engine.infer(batch)["log_probs"], base)
    assert (engine.infer(batch)["log_probs"] - base).abs().max() > 1e-3  # enabled again after the block


def test_frozen_weights_stay_in_the_compute_dtype_and_only_adapters_get_a_master_copy(tiny_qwen2):
    """bf16 compute over fp32 master weights on one process: no FSDP2 (no gathered copy), autocast."""
    engine = TrainEngine(model_cfg(tiny_qwen2, dtype="bf16"), optim_cfg(lora=lora()), head="lm")
    assert not engine.sharded and engine.precision.mixed
    for name, p in engine.model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    batch = rl_batch(rows=3, prompt_width=5, response_width=4, seed=2)
    out, _ = engine.forward(batch)
    loss_fn(out, batch, SimpleNamespace(global_tokens=float(batch["response_mask"].sum())))[0].backward()
    for name, p in engine.model.named_parameters():
        assert (p.grad is not None and p.grad.dtype == torch.float32) if p.requires_grad else p.grad is None, name
    assert engine.clip_and_step()[1]
    merged = dict(engine.rollout_weights(torch.bfloat16))
    assert set(merged) == {f"{n}.weight" for n in engine.adapters.layers}
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    assert "LoRA rank 4: 11.3K trained" in engine.describe()


def _bf16_rank(rank, path):
    from torch.distributed.tensor import DTensor

    engine = TrainEngine(model_cfg(path, dtype="bf16"), optim_cfg(lora=lora()), head="lm")
    batch = rl_batch(rows=4, prompt_width=5, response_width=4, seed=7)
    losses = [engine.train_step(batch, loss_fn)["loss"] for _ in range(3)]
    dtypes = {n: (p.dtype, p.requires_grad, isinstance(p, DTensor)) for n, p in engine.model.named_parameters()}
    merged = {n: t.clone() for n, t in engine.rollout_weights(torch.bfloat16)}
    return engine.sharded, losses, dtypes, merged


def test_two_ranks_shard_bf16_frozen_weights_and_fp32_adapters_with_fsdp2(tiny_qwen2):
    """The multi-GPU layout on two gloo ranks: FSDP2 shards the frozen bf16 weights and the fp32 adapters in one
    group each layer, gathers both in bf16 and reduces only the adapters' gradients."""
    results = run_ranks(2, _bf16_rank, str(tiny_qwen2))
    for sharded, losses, dtypes, merged in results:
        assert sharded and losses[-1] < losses[0]
        for name, (dtype, trained, dtensor) in dtypes.items():
            assert dtensor and dtype == (torch.float32 if trained else torch.bfloat16) and trained == (".lora_" in name)
        assert len(merged) == 2 * len(ALL) and all(t.dtype == torch.bfloat16 for t in merged.values())
    assert results[0][1] == results[1][1]
    for name, t in results[0][3].items():
        assert torch.equal(t, results[1][3][name]), name


def test_merged_weights_are_the_base_plus_the_scaled_product(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(alpha=12.0)), head="lm")
    engine.train_step(rl_batch(rows=3, prompt_width=5, response_width=4, seed=3), loss_fn)
    shapes = dict(engine.rollout_weight_shapes())
    for name, merged in engine.rollout_weights():
        layer = engine.adapters.layers[name.removesuffix(".weight")]
        expected = layer.base_layer.weight + 3.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(merged, expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(merged - layer.base_layer.weight, layer.get_delta_weight("default"))
        assert shapes[name] == tuple(merged.shape)
        assert (merged - layer.base_layer.weight).abs().max() > 0  # B moved off 0: the merge changes the weight


def test_adapter_dropout_is_off_in_log_prob_passes(tiny_qwen2):
    batch = rl_batch(rows=3, prompt_width=5, response_width=4, seed=4)
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=lora(dropout=0.5)), head="lm")
    engine.train_step(batch, loss_fn)  # B != 0, so dropout on the adapters' input changes the output
    first, second = engine.infer(batch)["log_probs"], engine.infer(batch)["log_probs"]
    assert torch.equal(first, second) and engine.model.training
    trained = [engine.forward(batch)[0]["log_probs"] for _ in range(2)]
    assert not torch.equal(trained[0], trained[1])


def test_compiled_lora_layers_equal_eager_ones(tiny_qwen2, monkeypatch):
    """Graph capture through peft's LoRA modules, adapters on and disabled: the engine compiles as under
    `model.compile`, on the `aot_eager` backend (CPU)."""
    from hybridflow.engine.train import engine as engine_module

    monkeypatch.setattr(engine_module, "compile_model", lambda model: compile_model(model, backend="aot_eager"))
    engines = []
    for compiled in (False, True):
        torch.manual_seed(0)
        engine = TrainEngine(model_cfg(tiny_qwen2, compile=compiled), optim_cfg(lora=lora()), head="lm")
        with torch.no_grad():  # B off 0, as after training: the adapters change the output
            for layer in engine.adapters.layers.values():
                layer.lora_B["default"].weight.normal_(std=0.1)
        engines.append(engine)
    batch = rl_batch(rows=4, prompt_width=6, response_width=5, seed=6)
    outs = []
    for engine in engines:
        out, _ = engine.forward(batch)
        out["log_probs"].sum().backward()
        with engine.adapters.disabled():
            base = engine.infer(batch)["log_probs"]
        outs.append((out["log_probs"], base, [p.grad.clone() for p in engine.model.parameters() if p.requires_grad]))
    (eager, eager_base, eager_grads), (comp, comp_base, comp_grads) = outs
    torch.testing.assert_close(comp, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comp_base, eager_base, atol=1e-5, rtol=1e-5)
    for a, b in zip(comp_grads, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_compiled_lora_layers_share_one_graph_over_three_steps(tiny_qwen2, compiled_graphs, quantization):
    """Every decoder layer of a LoRA model runs one compiled graph per pass, through 3 log-prob passes and updates of
    uneven micro-batches: one graph for the update, one for the no-grad log-prob pass. The frozen embeddings' output
    is marked as needing a gradient in the update, as every later layer's input does; unmarked, the first layer's
    input failed the `requires_grad` guard and compiled a second graph (its backward too under inductor), most of a
    LoRA run's first step. Marked in the no-grad pass too (transformers' `enable_input_require_grads`), it failed
    the same guard there; the NF4 base's weights add none (docs/small_gpus.md)."""
    if quantization == "nf4":
        pytest.importorskip("torchao")
    graphs = compiled_graphs
    engine = TrainEngine(model_cfg(tiny_qwen2, compile=True, quantization=quantization),
                         optim_cfg(lora=lora(), max_tokens_per_micro_batch=40), head="lm")
    batch = rl_batch(rows=6, prompt_width=6, response_width=7, seed=3)
    batch["advantages"] = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine.infer(batch, max_tokens=40)
        engine.train_step(batch, loss_fn)
    assert len(graphs) == 2, [g.code for g in graphs[2:]]


@pytest.mark.parametrize("head, targets", [("lm", []), ("lm", ["q_proj", "v_proj"]), ("value", ["o_proj"])])
def test_trained_parameters_counted_on_the_meta_device_equal_the_engine(tiny_qwen2, head, targets):
    cfg = lora(rank=3, target_modules=targets)
    engine = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(lora=cfg), head=head)
    assert trainable_params(AutoConfig.from_pretrained(tiny_qwen2), cfg, head) == engine.trained_params()


def test_lora_update_flops_count_no_weight_gradients_of_the_frozen_weights(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    full, frozen = train_flops(config, [10, 20]), train_flops(config, [10, 20], adapter_params=1000)
    assert full - frozen == (2 * matmul_params(config) - 6 * 1000) * 30
