"""verl's config keys and what each one is in hybridflow: one table behind both the loader's did-you-mean
(`verl_hint`: a verl key typed on our command line names our key) and `hybridflow migrate` (`translate`: a
verl command line or config becomes a recipe, with a note on every key it cannot carry).

`VERL_KEYS` maps a verl key (dotted, as on verl's command line) to a `VerlKey`: our key, or None when there is
no equivalent, a note saying what differs or why, and a `convert` for values that change shape. `convert`
gets the value and every verl key given (verl's defaults filled in for `VERL_DEFAULTS`) and returns
``{our key: value}``; an empty dict means the key is carried by another one (``custom_reward_function.name``
travels with ``.path``). `VERL_DEFAULTS` are verl defaults that differ from ours (docs/migrating_from_verl.md),
which a migrated recipe sets so the run does what the verl run did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]

ARR = "actor_rollout_ref."
A, R, M = ARR + "actor.", ARR + "rollout.", ARR + "model."
MT = R + "multi_turn."
RC = "algorithm.rollout_correction."
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


@dataclass(frozen=True)
class VerlKey:
    """ours: the hybridflow key (None: none); note: what differs, or why there is none; convert: see the
    module docstring (default: the value as it is, under `ours`)."""

    ours: str | None
    note: str = ""
    convert: Convert | None = None

    def values(self, value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        """``{our key: value}`` for verl's `value` (empty: nothing to carry)."""
        if self.convert is not None:
            return self.convert(value, given)
        return {self.ours: value} if self.ours else {}


def same(keys: dict[str, str | tuple[str, str]]) -> dict[str, VerlKey]:
    """Keys whose values carry over as they are: verl key -> our key, or (our key, note)."""
    return {verl: VerlKey(*((ours,) if isinstance(ours, str) else ours)) for verl, ours in keys.items()}


def truthy(value: Any) -> bool:
    """verl's boolean, written as a string (``True``, ``1``) or a value."""
    return str(value).lower() in ("true", "1") if isinstance(value, str) else bool(value)


def _kl_coef(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"actor.kl_loss_coef": float(given.get(A + "kl_loss_coef", 0.001)) if truthy(given.get(A + "use_kl_loss"))
            else 0.0}


def _workers(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    nnodes = int(given.get("trainer.nnodes", 1))
    out: dict[str, Any] = {"trainer.n_workers": int(given.get("trainer.n_gpus_per_node", 8)) * nnodes}
    if nnodes > 1:
        out.update({"trainer.backend": "ray", "ray.actor.nnodes": nnodes})
    return out


def _reward_function(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    path = given.get("custom_reward_function.path")
    return {"reward.function": f"{path}:{given.get('custom_reward_function.name', 'compute_score')}"} if path else {}


def _reward_model(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    path = given.get("reward_model.model.path")
    return {"reward.reward_model.path": path} if truthy(given.get("reward_model.enable")) and path else {}


def _dynamic_budget(verl: str, ours: str) -> Convert:
    """verl's `use_dynamic_bsz` + `ppo_max_token_len_per_gpu` of a role (prefix `verl`) -> our token budget."""
    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if not truthy(given.get(verl + "use_dynamic_bsz")):
            return {}
        return {ours: int(given.get(verl + "ppo_max_token_len_per_gpu", 16384))}

    return convert


def _ref_offload(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if int(given.get(M + "lora_rank", 0) or 0) > 0 and truthy(value):
        raise ValueError("with LoRA (lora_rank > 0) the reference is the actor's own base weights with the adapters "
                         "disabled: there is no copy to offload")
    return {"actor.ref_param_offload": truthy(value)}


def _truncation(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """verl drops prompts over max_prompt_length before `truncation` applies when filter_overlong_prompts is
    set: together they are our `filter`."""
    if truthy(given.get("data.filter_overlong_prompts")):
        return {"data.truncation": "filter"}
    if value not in ("error", "left", "right"):
        raise ValueError(f"truncation={value!r}: hybridflow has error, filter, left, right")
    return {"data.truncation": value}


def resume(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """verl's resume_mode (with resume_from_path) -> our `trainer.resume`."""
    if value == "disable":
        return {"trainer.resume": "never"}
    if value == "resume_path":
        return {"trainer.resume": given.get("trainer.resume_from_path")}
    return {"trainer.resume": "auto"}


def _correction(kind: str) -> Convert:
    """verl's rollout_is / rollout_rs level -> our `actor.rollout_correction.mode`."""
    modes = {"is": {"token": "token_tis", "sequence": "seq_tis"}, "rs": {"token": "token_mis", "sequence": "seq_mis"}}

    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        if value not in modes[kind]:
            raise ValueError(f"rollout_{kind}={value!r} has no hybridflow mode (token and sequence do)")
        return {"actor.rollout_correction.mode": modes[kind][value]}

    return convert


def loggers(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """verl's logger names -> ours, the ones we lack dropped (console when none is left)."""
    names = [value] if isinstance(value, str) else list(value)
    return {"trainer.loggers": [n for n in names if n in LOGGERS] or ["console"]}


def map_values(ours: str, mapping: dict[Any, Any]) -> Convert:
    """A value carried through `mapping` to `ours`; one it lacks is refused naming the valid ones."""
    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if value not in mapping:
            raise ValueError(f"value {value!r}: hybridflow has {', '.join(map(str, mapping.values()))}")
        return {ours: mapping[value]}

    return convert


def negative_is_off(ours: str) -> Convert:
    """verl's -1 (never) -> our 0."""
    return lambda value, given: {ours: 0 if value is None or int(value) < 0 else int(value)}


VERL_KEYS: dict[str, VerlKey] = {
    **same({k: k for k in ("data.train_files", "data.val_files", "data.prompt_key", "data.max_prompt_length",
                            "data.max_response_length", "data.val_batch_size",
                            "data.shuffle", "data.seed", "algorithm.adv_estimator",
                            "algorithm.gamma", "algorithm.lam", "algorithm.use_kl_in_reward", "algorithm.kl_penalty",
                            "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl",
                            "algorithm.kl_ctrl.horizon", "algorithm.filter_groups.enable",
                            "algorithm.filter_groups.metric", "algorithm.filter_groups.max_num_gen_batches",
                            "critic.cliprange_value", "trainer.total_epochs",
                            "trainer.val_before_train", "trainer.project_name", "trainer.experiment_name",
                            "trainer.device")}),
    **same({M + "path": "model.path", M + "trust_remote_code": "model.trust_remote_code",
             M + "enable_gradient_checkpointing": ("model.gradient_checkpointing", "null (default) = on for models under "
                                                   "1B parameters and where the device budget needs it"), M + "use_remove_padding":
             "actor.use_packing", A + "optim.lr": "actor.lr", A + "optim.min_lr_ratio": "actor.min_lr_ratio",
             A + "optim.weight_decay": "actor.weight_decay", A + "optim.betas": "actor.betas",
             A + "grad_clip": "actor.grad_clip",
             A + "ppo_mini_batch_size": ("actor.mini_batch_size", "prompts per optimizer step; null = the whole batch"),
             A + "ppo_micro_batch_size_per_gpu": ("actor.micro_batch_size", "rows per forward per device"),
             A + "ppo_epochs": "actor.ppo_epochs", "data.train_batch_size": ("data.train_batch_size", "prompts per step"),
             A + "shuffle": "actor.shuffle", A + "clip_ratio_low": "actor.clip_low",
             A + "clip_ratio_high": "actor.clip_high", A + "clip_ratio_c": "actor.clip_c",
             A + "loss_agg_mode": "actor.loss_agg", A + "entropy_coeff": "actor.entropy_coef",
             A + "kl_loss_type": "actor.kl_loss_type", A + "fsdp_config.param_offload": "actor.param_offload",
             A + "fsdp_config.optimizer_offload": "actor.optimizer_offload",
             A + "use_torch_compile": ("model.compile", "null (default) = on for CUDA, off on a CPU"), 
             R + "n": "rollout.n", R + "temperature": "rollout.temperature", R + "top_p": "rollout.top_p",
             R + "top_k": "rollout.top_k", R + "max_num_seqs": "rollout.max_num_seqs",
             R + "free_cache_engine": "rollout.free_cache_after_generate",
             R + "val_kwargs.temperature": "rollout.val_temperature", R + "val_kwargs.n": "rollout.val_n",
             "critic.model.path": ("critic.model.path", "null = start from the actor's model"),
             M + "lora_rank": ("actor.lora.rank", "0 = no LoRA (docs/lora.md)"), M + "lora_alpha": "actor.lora.alpha",
             M + "target_modules": ("actor.lora.target_modules", "module names; all-linear (verl's default) or [] = "
                                                                 "every linear layer of the decoder layers"), MT + "max_assistant_turns": "agent.max_turns",
             "critic.optim.lr": "critic.lr", "critic.model.use_remove_padding": "critic.use_packing",
             "critic.model.fsdp_config.param_offload": "critic.param_offload",
             "critic.model.fsdp_config.optimizer_offload": "critic.optimizer_offload",
             "critic.model.enable_gradient_checkpointing": "critic.model.gradient_checkpointing",
             "critic.model.trust_remote_code": "critic.model.trust_remote_code",
             "critic.ppo_epochs": "critic.ppo_epochs", "critic.grad_clip": "critic.grad_clip",
             "critic.optim.weight_decay": "critic.weight_decay", "critic.model.lora_rank": "critic.lora.rank",
             "critic.model.lora_alpha": "critic.lora.alpha", "critic.model.target_modules": "critic.lora.target_modules", "critic.ppo_mini_batch_size": "critic.mini_batch_size",
             "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size", "trainer.critic_warmup":
             "critic.warmup_steps", "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
             "trainer.total_training_steps": "trainer.total_steps", "trainer.log_val_generations": "trainer.log_samples",
             "trainer.default_local_dir": "trainer.output_dir", "trainer.max_actor_ckpt_to_keep":
             "trainer.keep_checkpoints", "reward_model.overlong_buffer.enable": "algorithm.overlong_buffer.enable",
             "reward_model.overlong_buffer.len": "algorithm.overlong_buffer.len",
             "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_buffer.penalty_factor",
             RC + "rollout_is_threshold": "actor.rollout_correction.threshold",
             RC + "rollout_rs_threshold": "actor.rollout_correction.threshold",
             RC + "rollout_rs_threshold_lower": "actor.rollout_correction.threshold_lower"}),
    A + "optim.lr_warmup_steps": VerlKey("actor.lr_warmup_steps", "-1 (verl: use the ratio) becomes 0",
                                         negative_is_off("actor.lr_warmup_steps")),
    A + "optim.warmup_style": VerlKey("actor.lr_schedule", "constant or cosine",
                                      map_values("actor.lr_schedule", {"constant": "constant", "cosine": "cosine"})),
    A + "optim.lr_scheduler_type": VerlKey("actor.lr_schedule", "constant or cosine",
                                           map_values("actor.lr_schedule", {"constant": "constant", "cosine": "cosine"})),
    A + "optim.lr_warmup_steps_ratio": VerlKey(None, "give the warm-up in optimizer steps: actor.lr_warmup_steps"),
    A + "use_dynamic_bsz": VerlKey("actor.max_tokens_per_micro_batch", "set = the token budget "
                                   "ppo_max_token_len_per_gpu; null = sized from the GPU's memory",
                                   _dynamic_budget(A, "actor.max_tokens_per_micro_batch")),
    "critic.use_dynamic_bsz": VerlKey("critic.max_tokens_per_micro_batch", "set = the token budget "
                                      "ppo_max_token_len_per_gpu; null = sized from the GPU's memory",
                                      _dynamic_budget("critic.", "critic.max_tokens_per_micro_batch")),
    "critic.ppo_max_token_len_per_gpu": VerlKey("critic.max_tokens_per_micro_batch", "with use_dynamic_bsz=True",
                                                lambda v, g: {}),
    ARR + "ref.fsdp_config.param_offload": VerlKey("actor.ref_param_offload", "not with LoRA: its reference is the "
                                                   "actor's base weights", _ref_offload),
    A + "ppo_max_token_len_per_gpu": VerlKey("actor.max_tokens_per_micro_batch", "with use_dynamic_bsz=True",
                                             lambda v, g: {}),
    A + "clip_ratio": VerlKey("actor.clip_low", "sets actor.clip_low and actor.clip_high",
                              lambda v, g: {"actor.clip_low": v, "actor.clip_high": v}),
    A + "policy_loss.loss_mode": VerlKey("actor.policy_loss", "vanilla is ppo",
                                         lambda v, g: {"actor.policy_loss": "ppo" if v == "vanilla" else v}),
    A + "use_kl_loss": VerlKey("actor.kl_loss_coef", "use_kl_loss + kl_loss_coef: the coefficient, 0 = no KL loss",
                               _kl_coef),
    A + "kl_loss_coef": VerlKey("actor.kl_loss_coef", "applies with use_kl_loss=True", lambda v, g: {}),
    R + "name": VerlKey("rollout.engine", "our own engine: vllm and sglang become auto",
                        map_values("rollout.engine", {"vllm": "auto", "sglang": "auto", "hf": "hf"})),
    R + "gpu_memory_utilization": VerlKey(None, "trainer.gpu_memory_utilization is the share of the GPU the whole run "
                                          "plans with (default 0.9); the KV cache gets what the rest leaves"),
    R + "enforce_eager": VerlKey("rollout.cuda_graphs", "inverted", lambda v, g: {"rollout.cuda_graphs": not truthy(v)}),
    R + "val_kwargs.do_sample": VerlKey("rollout.val_temperature", "do_sample=False is temperature 0",
                                        lambda v, g: {} if truthy(v) else {"rollout.val_temperature": 0.0}),
    R + "tensor_model_parallel_size": VerlKey(None, "each device runs a data-parallel rollout replica"),
    R + "log_prob_micro_batch_size_per_gpu": VerlKey(None, "log-prob passes use actor.micro_batch_size / "
                                                     "actor.max_tokens_per_micro_batch"),
    ARR + "ref.log_prob_micro_batch_size_per_gpu": VerlKey(None, "log-prob passes use actor.micro_batch_size / "
                                                           "actor.max_tokens_per_micro_batch"),
    ARR + "hybrid_engine": VerlKey(None, "always on"),
    R + "mode": VerlKey(None, "one rollout mode"),
    MT + "enable": VerlKey(None, "multi-turn is on when agent.environment or agent.tools is set"),
    MT + "tool_config_path": VerlKey("agent.tools", "verl's tool config YAML loads as one agent.tools entry",
                                     lambda v, g: {"agent.tools": [v]} if v else {}),
    MT + "interaction_config_path": VerlKey("agent.environment", "verl's interaction config YAML",
                                            lambda v, g: {"agent.environment": v} if v else {}),
    MT + "max_user_turns": VerlKey(None, "episodes are bounded by agent.max_turns model turns"),
    MT + "max_parallel_calls": VerlKey(None, "agent.max_tool_calls bounds the calls of a whole trajectory"),
    MT + "format": VerlKey(None, "tool calls are parsed in the Hermes / Qwen format"),
    RC + "rollout_is": VerlKey("actor.rollout_correction.mode", "token -> token_tis, sequence -> seq_tis",
                               _correction("is")),
    RC + "rollout_rs": VerlKey("actor.rollout_correction.mode", "token -> token_mis, sequence -> seq_mis",
                               _correction("rs")),
    "data.filter_overlong_prompts": VerlKey("data.truncation", "True is data.truncation=filter, whatever "
                                            "data.truncation says (verl drops those prompts before it applies)",
                                            lambda v, g: {"data.truncation": "filter"} if truthy(v) else {}),
    "data.truncation": VerlKey("data.truncation", "error, left, right; filter with filter_overlong_prompts=True",
                               _truncation),
    "data.return_raw_chat": VerlKey(None, "the raw prompt always travels with the rows"),
    "data.reward_fn_key": VerlKey(None, "data_source always travels with the rows"),
    "custom_reward_function.path": VerlKey("reward.function", "path + name become path:name", _reward_function),
    "custom_reward_function.name": VerlKey("reward.function", "travels with custom_reward_function.path",
                                           lambda v, g: {}),
    "reward_model.enable": VerlKey("reward.reward_model.path", "set = enabled", _reward_model),
    "reward_model.model.path": VerlKey("reward.reward_model.path", "with reward_model.enable=True", lambda v, g: {}),
    "reward_model.reward_manager": VerlKey(None, "one manager: a process pool with a per-row timeout "
                                           "(reward.num_workers, reward.timeout_s)"),
    "trainer.test_freq": VerlKey("trainer.val_every", "-1 becomes 0 (no periodic validation)",
                                 negative_is_off("trainer.val_every")),
    "trainer.save_freq": VerlKey("trainer.save_every", "-1 becomes 0 (only at the end)",
                                 negative_is_off("trainer.save_every")),
    "trainer.n_gpus_per_node": VerlKey("trainer.n_workers", "n_gpus_per_node x nnodes processes", _workers),
    "trainer.nnodes": VerlKey("trainer.n_workers", "n_gpus_per_node x nnodes; nnodes > 1 runs on Ray", _workers),
    "trainer.logger": VerlKey("trainer.loggers", "console, jsonl, tensorboard and wandb are carried, others dropped",
                              loggers),
    "trainer.resume_mode": VerlKey("trainer.resume", "auto, never (disable), or a checkpoint path", resume),
    "trainer.resume_from_path": VerlKey("trainer.resume", "with resume_mode=resume_path", lambda v, g: {}),
}

# Keys under a dict-valued verl key carried as keys of ours.
VERL_PREFIXES = {"custom_reward_function.reward_kwargs.": "reward.kwargs.",
                 "reward.reward_kwargs.": "reward.kwargs."}

# verl's top-level sections that hybridflow does not have; keys under them not in VERL_KEYS have no equivalent.
VERL_SECTIONS = ("actor_rollout_ref", "custom_reward_function", "reward_model", "ray_kwargs", "global_profiler",
                 "ray_init")

# verl defaults that differ from hybridflow's: a migrated recipe sets them unless the verl config does.
VERL_DEFAULTS = {"algorithm.adv_estimator": "gae", A + "shuffle": False, "trainer.total_epochs": 30,
                 A + "ppo_mini_batch_size": 256, "data.train_batch_size": 1024}


def render_verl_table(keys: Mapping[str, VerlKey] | None = None, prefixes: Mapping[str, str] | None = None) -> str:
    """A markdown table of verl keys (default `VERL_KEYS` and `VERL_PREFIXES`; verl's SFT keys pass their own)
    in docs/migrating_from_verl.md (a test checks it is current): verl key, ours, what differs."""
    keys = VERL_KEYS if keys is None else keys
    prefixes = VERL_PREFIXES if prefixes is None and keys is VERL_KEYS else prefixes or {}
    rows = ["| verl | hybridflow | notes |", "|---|---|---|"]
    entries = {**{k: (v.ours, v.note) for k, v in keys.items()},
               **{k[:-1]: (v[:-1], "each key under it is one of ours") for k, v in prefixes.items()}}
    for verl in sorted(entries):
        ours, note = entries[verl]
        rows.append(f"| `{verl}` | {f'`{ours}`' if ours else '—'} | {note} |")
    return "\n".join(rows) + "\n"


def verl_hint(key: str) -> str | None:
    """What an unknown `key` is when it is verl's: ``"verl's key; in hybridflow it is 'actor.lr'"``, or why
    there is none; None when the key is not verl's."""
    entry = VERL_KEYS.get(key)
    if entry is None:
        for prefix, ours in VERL_PREFIXES.items():
            if key.startswith(prefix):
                return f"verl's key; in hybridflow it is '{ours}{key[len(prefix):]}'"
        if key.split(".", 1)[0] in VERL_SECTIONS:
            return ("a verl key hybridflow has no equivalent of (its actor_rollout_ref.* keys are model.*, actor.*, "
                    "rollout.*; docs/migrating_from_verl.md, or `hybridflow migrate` a verl command or config)")
        return None
    if entry.ours is None:
        return f"verl's key; hybridflow has no equivalent: {entry.note}"
    return f"verl's key; in hybridflow it is '{entry.ours}'" + (f": {entry.note}" if entry.note else "")
