"""Checks across keys of an `RLConfig` (and an `SFTConfig` or a preference config), run before any model loads:
batch sizes, ranges, estimators, distillation; the rollout keys (`hybridflow.config.rollout_checks`); the agent
section (`hybridflow.config.agent_checks`); what the run will read (`hybridflow.config.input_checks`) and the
optional packages and LoRA targets it needs (`hybridflow.config.extras`).

`validate(cfg, n_workers)` collects every problem and raises one `ConfigError` listing them all, each
naming the keys, their values and the values that would be valid, e.g.

    actor.mini_batch_size=3 must divide data.train_batch_size=8; valid: 1, 2, 4, 8

Batch semantics (verl's): a step takes `data.train_batch_size` prompts, `rollout.n` responses each; an
optimizer step takes `mini_batch_size` prompts (`mini_batch_size x n` rows), split evenly over the
`n_workers` ranks; each rank runs forwards of `micro_batch_size` rows.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from hybridflow.config.agent_checks import agent_problems
from hybridflow.config.exact_checks import exact_problems
from hybridflow.config.fp8_checks import fp8_problems
from hybridflow.config.small_card_checks import cap_problems, quantization_problems
from hybridflow.config.extras import config_value, lora_target_problems, moe_model_problems, package_problems
from hybridflow.config.input_checks import data_file_problems, model_problems, path_problems, run_problems
from hybridflow.config.rollout_checks import (divisors, join_values, moe_problems, off_policy_problems,
                                              placement_problems)
from hybridflow.config.role_needs import (GROUP_KEYS, distills, needs_critic, needs_greedy_baseline, run_groups,
                                          uses_task_advantage)
from hybridflow.config.schema import GROUP_ESTIMATORS, PoolConfig, RayConfig

# GSPO's bounds are on a sequence-level ratio: a bound this large (PPO's are 0.2) never clips.
GSPO_CLIP_LIMIT = 0.01


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and what would be valid. `problems`: each
    problem the message lists (`raise_if_any`), so that a caller gathering problems from several checks
    (`hybridflow.trainer.preflight`) lists them once each, under one heading."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def _batch_problems(role: str, cfg: Any, n_workers: int) -> list[str]:
    """Mini- and micro-batch relations of one trained role (`actor` or `critic`)."""
    section = getattr(cfg, role)
    prompts, n = cfg.data.train_batch_size, cfg.rollout.n
    if prompts < 1 or n < 1:
        return []  # reported by the range checks
    problems = _mini_batch_problems(f"{role}.mini_batch_size", section.mini_batch_size, prompts)
    if problems:
        return problems
    mini = section.mini_batch_size if section.mini_batch_size is not None else prompts
    mini_desc = (f"{role}.mini_batch_size={mini}" if section.mini_batch_size is not None
                 else f"{role}.mini_batch_size=null (the whole batch, {prompts} prompts)")
    rows = mini * n
    if rows % n_workers:
        valid = [m for m in divisors(prompts) if m * n % n_workers == 0]
        fix = (f"valid {role}.mini_batch_size: {join_values(valid)}" if valid else
               f"no mini_batch_size works; valid trainer.n_workers: {join_values(divisors(prompts * n))}")
        return [f"{role} mini-batch rows ({mini_desc} x rollout.n={n} = {rows}) must divide by "
                f"trainer.n_workers={n_workers}; {fix}"]
    per_rank = rows // n_workers
    micro = section.micro_batch_size
    if micro is not None and section.max_tokens_per_micro_batch is None and (micro < 1 or per_rank % micro):
        return [f"{role}.micro_batch_size={micro} must divide the per-rank mini-batch of {per_rank} rows "
                f"(mini_batch_size {mini} x rollout.n {n} / n_workers {n_workers}); "
                f"valid: {join_values(divisors(per_rank))}"]
    budget = section.max_tokens_per_micro_batch
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if budget is not None and budget < longest:
        return [f"{role}.max_tokens_per_micro_batch={budget} is below one full sequence "
                f"(data.max_prompt_length + data.max_response_length = {longest}); use >= {longest}"]
    return []


def _range_problems(cfg: Any) -> list[str]:
    """Values that must be positive, non-negative or inside an interval."""
    at_least = {
        1: ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "rollout.n",
            "rollout.val_n", "rollout.max_num_seqs", "actor.ppo_epochs", "critic.ppo_epochs",
            "trainer.total_epochs", "trainer.n_workers", "trainer.keep_checkpoints",
            "reward.reward_model.micro_batch_size"],
        0: ["trainer.val_every", "trainer.save_every", "trainer.log_samples", "trainer.log_rollouts",
            "trainer.max_bad_steps", "trainer.worker_timeout_s", "reward.max_failed_steps",
            "actor.lr_warmup_steps", "critic.lr_warmup_steps", "critic.warmup_steps", "actor.kl_loss_coef",
            "actor.entropy_coef", "actor.clip_low", "actor.clip_high", "critic.cliprange_value",
            "rollout.temperature", "rollout.val_temperature", "actor.grad_clip", "critic.grad_clip",
            "actor.weight_decay", "critic.weight_decay", "algorithm.kl_ctrl.kl_coef",
            "algorithm.filter_groups.max_num_gen_batches", "reward.num_workers", "rollout.partial_extra_batches",
            "rollout.max_staleness"],
    }
    intervals = {  # key: (low, high, low inclusive, high inclusive)
        "rollout.top_p": (0.0, 1.0, False, True), "trainer.gpu_memory_utilization": (0.0, 1.0, False, True),
        "algorithm.gamma": (0.0, 1.0, True, True), "algorithm.lam": (0.0, 1.0, True, True),
        "actor.min_lr_ratio": (0.0, 1.0, True, True), "critic.min_lr_ratio": (0.0, 1.0, True, True),
        "actor.lr": (0.0, float("inf"), False, False), "critic.lr": (0.0, float("inf"), False, False),
        "reward.timeout_s": (0.0, float("inf"), False, False),
    }
    problems = _bound_problems(cfg, at_least, intervals)
    for key in ("data.val_batch_size", "actor.mini_batch_size", "critic.mini_batch_size"):
        value = config_value(cfg, key)
        if value is not None and value < 1:
            problems.append(f"{key}={value} must be >= 1 or null")
    fraction = cfg.rollout.kv_cache_fraction
    if fraction is not None and not 0.0 < fraction < 1.0:
        problems.append(f"rollout.kv_cache_fraction={fraction} must be in (0.0, 1.0) or null (device budget)")
    problems += _precision_problems(cfg, (("actor", "model"), ("critic", "critic.model")))
    problems += quantization_problems(cfg, (("actor", "model"), ("critic", "critic.model"))) + cap_problems(cfg)
    problems += _lora_problems(cfg, ("actor", "critic"))
    if cfg.actor.clip_c <= 1.0:
        problems.append(f"actor.clip_c={cfg.actor.clip_c} must be > 1 (dual-clip bound)")
    corr = cfg.actor.rollout_correction
    if corr.threshold <= 0:
        problems.append(f"actor.rollout_correction.threshold={corr.threshold} must be > 0")
    elif corr.threshold_lower is not None and not 0 < corr.threshold_lower < corr.threshold:
        problems.append(f"actor.rollout_correction.threshold_lower={corr.threshold_lower} must be in (0, "
                        f"actor.rollout_correction.threshold={corr.threshold}), or null (= 1/threshold)")
    return problems


def _bound_problems(cfg: Any, at_least: dict[int, list[str]],
                    intervals: dict[str, tuple[float, float, bool, bool]]) -> list[str]:
    """Keys below their lower bound, keys outside their interval (low, high, low inclusive, high inclusive),
    and `trainer.total_steps` below 1."""
    problems = []
    for low, keys in at_least.items():
        for key in keys:
            value = config_value(cfg, key)
            if value < low:
                problems.append(f"{key}={value} must be >= {low}")
    for key, (lo, hi, lo_in, hi_in) in intervals.items():
        value = config_value(cfg, key)
        if not ((value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi)):
            bounds = f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
            problems.append(f"{key}={value} must be in {bounds}")
    steps = cfg.trainer.total_steps
    if steps is not None and steps < 1:
        problems.append(f"trainer.total_steps={steps} must be >= 1 (or null = trainer.total_epochs)")
    return problems


def _mini_batch_problems(key: str, mini: int | None, batch: int) -> list[str]:
    """A mini-batch size (null = the whole batch) must divide `data.train_batch_size`."""
    if mini is None or (mini >= 1 and batch % mini == 0):
        return []
    return [f"{key}={mini} must divide data.train_batch_size={batch}; valid: {join_values(divisors(batch))} or null"]


def _precision_problems(cfg: Any, sections: tuple[tuple[str, str], ...]) -> list[str]:
    """Master dtype and optimizer of each (optimizer section, model section): bf16 master weights need the
    optimizer that rounds stochastically, and a bf16 compute dtype."""
    problems = []
    for role, model in sections:
        master, optimizer = config_value(cfg, f"{model}.master_dtype"), config_value(cfg, f"{role}.optimizer")
        if master == "bf16" and optimizer not in ("adamw_8bit", "auto"):
            problems.append(f"{model}.master_dtype=bf16 needs {role}.optimizer=adamw_8bit (its stochastic rounding "
                            f"keeps updates below bf16's resolution; unset, it follows); got "
                            f"{role}.optimizer={optimizer}")
        if master == "bf16" and config_value(cfg, f"{model}.dtype") == "fp32":
            problems.append(f"{model}.master_dtype=bf16 is below {model}.dtype=fp32; use {model}.dtype=bf16 or auto")
    return problems


def _lora_problems(cfg: Any, sections: tuple[str, ...]) -> list[str]:
    """Each `<section>.lora`: a rank >= 0, a positive alpha, a dropout in [0, 1); a LoRA actor has no reference
    copy to offload."""
    problems = []
    actor = getattr(cfg, "actor", None)
    if actor is not None and actor.lora.rank > 0 and actor.ref_param_offload:
        problems.append(f"actor.ref_param_offload=true offloads the reference model's copy, which a LoRA actor "
                        f"(actor.lora.rank={actor.lora.rank}) does not have: its reference is its own base weights "
                        f"under disabled adapters; set actor.ref_param_offload=false")
    from hybridflow.engine.train.lora import target_names

    for section in sections:
        lora = config_value(cfg, f"{section}.lora")
        try:
            target_names(lora.target_modules)
        except ValueError as e:
            problems.append(f"{section}.{e}")
        if lora.rank < 0:
            problems.append(f"{section}.lora.rank={lora.rank} must be >= 0 (0 = no LoRA)")
        if lora.alpha <= 0:
            problems.append(f"{section}.lora.alpha={lora.alpha} must be > 0")
        if not 0.0 <= lora.dropout < 1.0:
            problems.append(f"{section}.lora.dropout={lora.dropout} must be in [0.0, 1.0)")
        if lora.target_parameters and lora.dropout:
            problems.append(f"{section}.lora.dropout={lora.dropout} cannot apply to expert weights "
                            f"({section}.lora.target_parameters={list(lora.target_parameters)}): their update is "
                            f"added to the weight, not to each input; use {section}.lora.dropout=0")
    return problems


def _algorithm_problems(cfg: Any) -> list[str]:
    """What the chosen estimator and options need from the rest of the config."""
    alg, n, problems = cfg.algorithm, cfg.rollout.n, []
    est = alg.adv_estimator
    if est in GROUP_ESTIMATORS and n < 2 and uses_task_advantage(cfg):
        problems.append(f"algorithm.adv_estimator={est} compares the responses of one prompt: "
                        f"rollout.n={n} must be >= 2")
    if est in GROUP_ESTIMATORS and n >= 2 and cfg.rollout.temperature <= 0 and uses_task_advantage(cfg):
        problems.append(f"algorithm.adv_estimator={est} with rollout.temperature=0 (greedy): the {n} responses "
                        f"of a prompt are identical, so every advantage is 0; use rollout.temperature > 0")
    if cfg.rollout.val_n > 1 and cfg.rollout.val_temperature <= 0:
        problems.append(f"rollout.val_n={cfg.rollout.val_n} with rollout.val_temperature=0 (greedy) repeats one "
                        f"response; use rollout.val_n=1 or rollout.val_temperature > 0")
    if needs_greedy_baseline(cfg) and cfg.rollout.temperature <= 0:
        problems.append("algorithm.adv_estimator=remax subtracts a greedy response's reward as baseline: "
                        f"rollout.temperature={cfg.rollout.temperature} must be > 0 (sampled responses)")
    actor = cfg.actor
    if actor.policy_loss == "gspo" and max(actor.clip_low, actor.clip_high) >= GSPO_CLIP_LIMIT:
        problems.append(f"actor.policy_loss=gspo clips a sequence-level ratio (the geometric mean of the token "
                        f"ratios, far closer to 1 than one token's): actor.clip_low={actor.clip_low} / "
                        f"actor.clip_high={actor.clip_high} are PPO-sized (>= {GSPO_CLIP_LIMIT}) and would almost "
                        f"never clip; use the GSPO paper's actor.clip_low=3e-4 actor.clip_high=4e-4 "
                        f"(recipes/gspo.yaml)")
    if alg.filter_groups.enable and n < 2:
        problems.append(f"algorithm.filter_groups.enable=true needs rollout.n >= 2 (got {n})")
    buf, max_len = alg.overlong_buffer, cfg.data.max_response_length
    if buf.enable and not 1 <= buf.len < max_len:
        problems.append(f"algorithm.overlong_buffer.len={buf.len} must be in [1, data.max_response_length="
                        f"{max_len})")
    if alg.kl_ctrl.type == "adaptive" and not alg.use_kl_in_reward:
        problems.append("algorithm.kl_ctrl.type=adaptive controls the in-reward KL: "
                        "set algorithm.use_kl_in_reward=true (unset, it follows)")
    if not needs_critic(cfg) and cfg.critic.warmup_steps > 0:
        problems.append(f"critic.warmup_steps={cfg.critic.warmup_steps} needs a critic "
                        f"(algorithm.adv_estimator=gae), got adv_estimator={est}")
    return problems


def _teacher_problems(cfg: Any) -> list[str]:
    """On-policy distillation: a positive weight, no KL-in-reward without the task reward it shapes (the
    teacher's directory and tokenizer: `hybridflow.config.input_checks`)."""
    teacher = cfg.teacher
    problems: list[str] = []
    if not distills(cfg):
        if teacher.topk:
            problems.append(f"teacher.topk={teacher.topk} distils from a teacher's top-k; set teacher.model.path")
        return problems
    if teacher.kl_coef < 0 or (teacher.kl_coef == 0 and not teacher.topk):
        problems.append(f"teacher.kl_coef={teacher.kl_coef} must be > 0 (the weight of the distillation advantage), "
                        f"or 0 with teacher.topk > 0 (the top-k divergence alone)")
    if teacher.topk < 0 or (teacher.topk > 0 and teacher.topk_coef <= 0):
        problems.append(f"teacher.topk={teacher.topk} must be >= 0 (0: off), and teacher.topk_coef={teacher.topk_coef} "
                        f"> 0 with it (the weight of the top-k divergence)")
    if not 0 <= teacher.topk_beta <= 1:
        problems.append(f"teacher.topk_beta={teacher.topk_beta} must be in [0, 1] (1: reverse KL, 0: forward KL)")
    if cfg.algorithm.use_kl_in_reward and not teacher.task_reward:
        problems.append("algorithm.use_kl_in_reward=true shapes the task reward, which distillation alone "
                        "(teacher.task_reward=false) does not use; set teacher.task_reward=true or use "
                        "actor.kl_loss_coef for a KL term")
    return problems


def _non_finite(cfg: Any, prefix: str = "") -> list[str]:
    """`key=value` of every float of a config that is NaN or infinite, by one rule for every key of every config
    kind: a float field, or a float in a list field (`actor.betas`, `reward.weights`); a mapping's values are
    the user's own keyword arguments and are not looked at. No key gives infinity a meaning ("no limit" is
    `null` or 0 where a key has one), so none is exempt."""
    out = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            out += _non_finite(value, f"{prefix}{f.name}.")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                out.append(f"{prefix}{f.name}={value!r} must be a finite number (NaN and infinity are refused)")
                break
    return out


def changed_keys(section: Any, default: Any, prefix: str) -> list[str]:
    """`prefix.key=value` for every key of a config section that differs from its default (nested too)."""
    out = []
    for f in fields(section):
        value, base = getattr(section, f.name), getattr(default, f.name)
        if hasattr(value, "__dataclass_fields__"):
            out += changed_keys(value, base, f"{prefix}.{f.name}")
        elif value != base:
            out.append(f"{prefix}.{f.name}={value}")
    return out


def _ray_problems(cfg: Any) -> list[str]:
    """`ray.*` needs the Ray backend, `ray.rollout` a separate rollout group, and each group's processes
    must split evenly over its `nnodes`."""
    if cfg.trainer.backend != "ray":
        changed = changed_keys(cfg.ray, RayConfig(), "ray")
        return [f"{', '.join(changed)} place worker groups on a Ray cluster, but trainer.backend="
                f"{cfg.trainer.backend} runs them on this machine; set trainer.backend=ray (unset, it follows)"
                ] if changed else []
    problems = []
    address = cfg.ray.address
    if address is not None and address.startswith("ray://"):
        problems.append(f"ray.address={address} is a Ray Client address, which hybridflow does not support (its "
                        f"workers reach the controller directly); run the controller on a node of the cluster "
                        f"with ray.address=auto or ray.address=HEAD_IP:6379")
    pools = run_groups(cfg)
    if "rollout" not in pools and (changed := changed_keys(cfg.ray.rollout, PoolConfig(), "ray.rollout")):
        problems.append(f"{', '.join(changed)} place the separate rollout group, which this run does not start; "
                        f"set rollout.placement=separate (unset, it follows) or leave ray.rollout at its defaults")
    for name in ("actor", "rollout"):
        nnodes, size_key = getattr(cfg.ray, name).nnodes, GROUP_KEYS[name][1]
        if name in pools and (nnodes < 1 or pools[name] % nnodes):
            problems.append(f"ray.{name}.nnodes={nnodes} must divide the {name} group's {pools[name]} processes "
                            f"({size_key}) into equal shares per node; valid: {join_values(divisors(pools[name]))}")
    return problems


def validate(cfg: Any, n_workers: int | None = None, check_paths: bool = True) -> None:
    """Raises one `ConfigError` listing every cross-key problem of an `RLConfig`.

    `n_workers` (processes per worker group) defaults to `cfg.trainer.n_workers`. The critic's batch
    relations are checked only when a critic trains (`algorithm.adv_estimator=gae`). With
    `check_paths=False` the files and directories are not looked at (`model.path` and
    `data.train_files` may then be unset), e.g. to check a recipe on its own.
    """
    n_workers = cfg.trainer.n_workers if n_workers is None else n_workers
    raise_if_any(_non_finite(cfg))  # first: the range checks below compare, and NaN passes every comparison
    problems = (_range_problems(cfg) + _algorithm_problems(cfg) + placement_problems(cfg)
                + off_policy_problems(cfg) + _ray_problems(cfg) + agent_problems(cfg) + _teacher_problems(cfg)
                + package_problems(cfg) + moe_problems(cfg))
    if check_paths:
        problems += path_problems(cfg) + moe_model_problems(cfg)
    problems += exact_problems(cfg, check_paths) + fp8_problems(cfg, check_paths)
    if n_workers >= 1:
        roles = ["actor", "critic"] if needs_critic(cfg) else ["actor"]
        for role in roles:
            problems += _batch_problems(role, cfg, n_workers)
    raise_if_any(problems)


def validate_sft(cfg: Any, rows_per_example: int = 1, more: list[str] | None = None) -> None:
    """Raises one `ConfigError` listing every problem of an `SFTConfig` (`hybridflow.config.sft_schema`), or of
    another program of its shape (`hybridflow.config.preference_schema`: `rows_per_example=2`, a pair's two
    sequences sharing a micro-batch; `more`: that program's own problems), before any model loads: the RL
    checks that apply to it (bounds, model and data paths, resume, device, the mini-batch relation) and its own."""
    data, optim, run = cfg.data, cfg.optim, cfg.trainer
    raise_if_any(_non_finite(cfg))  # first, as in `validate`
    problems = _bound_problems(cfg, {1: ["data.train_batch_size", "trainer.n_workers", "optim.passes_per_batch",
                                         "trainer.total_epochs"]},
                               {"optim.lr": (0.0, float("inf"), False, False),
                                "trainer.gpu_memory_utilization": (0.0, 1.0, False, True)})
    problems += _precision_problems(cfg, (("optim", "model"),)) + _lora_problems(cfg, ("optim",))
    problems += quantization_problems(cfg, (("optim", "model"),)) + cap_problems(cfg)
    problems += model_problems(cfg, ("model.path", "model.tokenizer_path")) + data_file_problems(cfg)
    problems += lora_target_problems(cfg, (("optim", "model.path", "lm"),)) + run_problems(cfg)
    problems += package_problems(cfg)
    if data.train_batch_size < run.n_workers:
        problems.append(f"data.train_batch_size={data.train_batch_size} gives some of trainer.n_workers="
                        f"{run.n_workers} ranks no conversation; use >= {run.n_workers}")
    problems += _mini_batch_problems("optim.mini_batch_size", optim.mini_batch_size, data.train_batch_size)
    budget = optim.max_tokens_per_micro_batch
    if budget is not None and data.max_length is not None and budget < data.max_length * rows_per_example:
        need = data.max_length * rows_per_example
        limit = f"data.max_length={data.max_length}" if rows_per_example == 1 else \
            f"{rows_per_example} x data.max_length={data.max_length} (the sequences of one example share a forward)"
        problems.append(f"optim.max_tokens_per_micro_batch={budget} is below {limit}; use >= {need}")
    raise_if_any(problems + list(more or ()))


def raise_if_any(problems: list[str]) -> None:
    """Raises one `ConfigError` listing `problems`, if there are any."""
    if problems:
        head = "invalid configuration:" if len(problems) == 1 else f"{len(problems)} problems in the configuration:"
        raise ConfigError(head + "\n  - " + "\n  - ".join(problems), problems)
