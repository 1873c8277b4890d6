"""What each worker group will hold on its devices, read from an `RLConfig` before any model loads.

`device_demands(cfg)` returns one `hybridflow.engine.budget.DeviceDemand` per group of an RL run (``actor``: the actor,
its reference and rollout engine when colocated, the critic, reward model and distillation teacher when they
share its processes; ``critic`` with `trainer.placement=split`; ``rollout`` with `rollout.placement=separate`);
`sft_demand(cfg)` the one of an SFT run's workers. A LoRA role trains its adapters alone (counted on the meta
device), and a LoRA actor's reference is its own base weights, which take no memory of their own.
Each worker plans its device from its group's demand (`budget.plan_for_device`) and refuses to start if
the run cannot fit. Model sizes come from the Hugging Face configs (parameters counted on the meta
device); nothing here touches a GPU. Under `trainer.device_memory_gib` each demand carries the cap, and a cap
below the weights' own size is refused here, on the controller (`budget.check_weights_fit`).
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.resolved import RunFacts
from hybridflow.config.role_needs import rollout_workers
from hybridflow.engine.budget import (GIB, DeviceDemand, FrozenRole, ModelShape, RolloutRole, TrainedRole,
                                      check_weights_fit)
from hybridflow.engine.train.lora import adapted_expert_params, shareable_params, trainable_params
from hybridflow.engine.train.quantized_base import quantized_params


def _compute_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2  # auto is bf16 on a GPU, the only device budgeted


def _config(model_cfg: Any, path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)


def _shape(model_cfg: Any, path: str, head: str) -> ModelShape:
    return ModelShape.from_config(_config(model_cfg, path), head, model_cfg.trust_remote_code)


def _trained(keys: str, model_keys: str, model_cfg: Any, role_cfg: Any, path: str, head: str,
             lora: bool, images: bool = False) -> TrainedRole:
    """The role of config section `keys` training the model at `path` (with `lora`: its adapters, counted
    here; with a 4-bit base, the weights it quantizes; `images`: the run's prompts carry images, `RunFacts.vision`)."""
    config = _config(model_cfg, path)
    quantized, largest = quantized_params(config, role_cfg.lora, head, model_cfg.trust_remote_code) \
        if lora and model_cfg.quantization == "nf4" else (0, 0)
    return TrainedRole(keys=keys, model_keys=model_keys,
                       shape=ModelShape.from_config(config, head, model_cfg.trust_remote_code, images),
                       compute_bytes=_compute_bytes(model_cfg.dtype),
                       master_bytes=4 if model_cfg.master_dtype == "fp32" else 2, optimizer=role_cfg.optimizer,
                       param_offload=role_cfg.param_offload, optimizer_offload=role_cfg.optimizer_offload,
                       gradient_checkpointing=model_cfg.gradient_checkpointing,
                       max_tokens=role_cfg.max_tokens_per_micro_batch, micro_batch_rows=role_cfg.micro_batch_size,
                       lora_params=trainable_params(config, role_cfg.lora, head, model_cfg.trust_remote_code, images)
                       if lora else None,
                       expert_lora_params=adapted_expert_params(config, role_cfg.lora, model_cfg.trust_remote_code)
                       if lora else 0, quantized_params=quantized, largest_quantized=largest)


def _cap(cfg: Any) -> int | None:
    """`trainer.device_memory_gib` in bytes (None: the whole card)."""
    gib = cfg.trainer.device_memory_gib
    return None if gib is None else int(gib * GIB)


def device_demands(cfg: Any, facts: RunFacts) -> dict[str, DeviceDemand]:
    """{group name: its per-device demand} for the groups `build_roles` starts."""
    actor = _trained("actor", "model", cfg.model, cfg.actor, cfg.model.path, "lm", facts.actor_lora, facts.vision)
    actor_shape = actor.shape
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    common = dict(world_size=cfg.trainer.n_workers, longest_sequence=longest,
                  utilization=cfg.trainer.gpu_memory_utilization, memory_cap=_cap(cfg))
    rollout = RolloutRole(shape=actor_shape, compute_bytes=_compute_bytes(cfg.model.dtype),
                          max_num_seqs=cfg.rollout.max_num_seqs, max_model_len=longest,
                          offload_weights=cfg.rollout.offload_weights,
                          cache_stays=not cfg.rollout.free_cache_after_generate,
                          kv_cache_fraction=cfg.rollout.kv_cache_fraction,
                          shared_params=shareable_params(_config(cfg.model, cfg.model.path), cfg.actor.lora,
                                                         cfg.model.trust_remote_code)
                          if facts.lend_frozen_weights else 0, fp8=cfg.rollout.quantization == "fp8",
                          min_seqs=max(cfg.rollout.n, cfg.rollout.val_n),
                          prefill_keeps_cache=facts.vision)
    trained = [actor]
    frozen = []
    if facts.reference_copy:  # a LoRA actor's reference is its own base weights
        frozen.append(FrozenRole("actor.ref_param_offload", actor_shape, _compute_bytes(cfg.model.dtype),
                                 cfg.actor.ref_param_offload))
    if cfg.reward.reward_model.path:
        frozen.append(FrozenRole(None, _shape(cfg.model, cfg.reward.reward_model.path, "value"),
                                 _compute_bytes(cfg.model.dtype)))
    if facts.teacher:
        teacher = cfg.teacher
        frozen.append(FrozenRole("teacher.param_offload", _shape(teacher.model, teacher.model.path, "lm"),
                                 _compute_bytes(teacher.model.dtype), teacher.param_offload))
    out = {}
    if facts.critic:
        critic = _trained("critic", "critic.model", cfg.critic.model, cfg.critic,
                          cfg.critic.model.path or cfg.model.path, "value", facts.critic_lora)
        if facts.split_critic:
            out["critic"] = DeviceDemand(trained=(critic,), **common)
        else:
            trained.append(critic)
    separate = facts.separate_rollout
    out["actor"] = DeviceDemand(trained=tuple(trained), frozen=tuple(frozen), rollout=None if separate else rollout,
                                **common)
    if separate:
        out["rollout"] = DeviceDemand(rollout=rollout, **{**common, "world_size": rollout_workers(cfg)})
    for demand in out.values():
        check_weights_fit(demand)
    return out


def sft_demand(cfg: Any, head: str = "lm", rows_per_example: int = 1) -> DeviceDemand:
    """An `SFTConfig`'s per-device demand: the model it fine-tunes (section `optim`), nothing else; without
    `data.max_length` the longest conversation is the model's context. The preference programs' too: `head`
    `score` for a reward model, `rows_per_example=2` for a pair's two sequences, which share a micro-batch."""
    role = _trained("optim", "model", cfg.model, cfg.optim, cfg.model.path, head, cfg.optim.lora.rank > 0)
    longest = cfg.data.max_length or getattr(_config(cfg.model, cfg.model.path), "max_position_embeddings",
                                             None) or 4096
    demand = DeviceDemand(trained=(role,), world_size=cfg.trainer.n_workers,
                          longest_sequence=longest * rows_per_example, utilization=cfg.trainer.gpu_memory_utilization,
                          memory_cap=_cap(cfg))
    check_weights_fit(demand)
    return demand
