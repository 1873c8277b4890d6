"""The typed configuration of `hybridflow train`: one dataclass per section, every default defined once.

Each field is declared with `opt(default, help, choices=...)` (`hybridflow.config.options`): the help line and
the valid choices live in the field's metadata, so the loader names valid values in its errors and
`docs/config.md` is generated from these classes (`python scripts/gen_config_docs.py`). Workers read these
objects by attribute. The `agent` section is `hybridflow.config.agent_schema`'s, `ray` is
`hybridflow.config.ray_schema`'s.

The root is `RLConfig(model, data, rollout, actor, critic, algorithm, reward, teacher, agent, trainer, ray)`;
the loader (`hybridflow.config.loader.load_config`) takes any such root dataclass through `schema=`, so other
programs (the SFT and preference trainers) bring their own root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

from hybridflow.config.agent_schema import AgentConfig
from hybridflow.config.model_schema import FrozenModelConfig, ModelConfig, OptimConfig
from hybridflow.config.options import opt, registered
from hybridflow.config.ray_schema import PoolConfig, RayConfig

# Estimators that compare the n samples of one prompt, so they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
TRUNCATION_MODES = ("error", "filter", "left", "right")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


@dataclass
class DataConfig:
    """Prompt datasets (verl-format parquet, jsonl) and prompt/response lengths."""

    train_files: list[str] = opt([], "training prompt files: one path or a list (parquet or jsonl)")
    val_files: list[str] = opt([], "validation prompt files: one path or a list; [] = no validation")
    prompt_key: str = opt("prompt", "column holding the prompt (chat messages or a plain string)")
    train_batch_size: int = opt(32, "prompts per training step (rows = train_batch_size x rollout.n)")
    val_batch_size: Optional[int] = opt(None, "prompts per validation generation batch; null = all at once")
    max_prompt_length: int = opt(512, "longest prompt in tokens (after the chat template)")
    max_response_length: int = opt(512, "most tokens generated per response")
    truncation: str = opt("error", "prompts over max_prompt_length: refuse, drop, or cut from the left/right",
                          TRUNCATION_MODES)
    apply_chat_template: bool = opt(True, "render prompts with the tokenizer's chat template")
    image_key: Optional[str] = opt(None, "column of each row's images (verl's `images`: a list of {bytes}/{path} "
                                         "mappings or paths), placed where the prompt says `<image>`; null = no "
                                         "images, or `images` when model.path is a vision-language model and no "
                                         "endpoint way in (agent.runner, ...) sends the images (followed; "
                                         "docs/models.md#vision-language-models)")
    shuffle: bool = opt(True, "shuffle training prompts each epoch (seeded)")
    seed: Optional[int] = opt(None, "shuffling seed; null = trainer.seed")


@dataclass
class RolloutConfig:
    """Generation of responses during training and validation."""

    n: int = opt(1, "responses sampled per prompt")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling probability mass, in (0, 1]")
    top_k: int = opt(-1, "sample among the k most likely tokens; -1 = all")
    engine: str = opt("auto", "generation engine: our fast engine, the transformers fallback, or auto",
                      ("auto", "fast", "hf"))
    max_num_seqs: int = opt(256, "most sequences decoded together (on a CPU at most data.train_batch_size x n, "
                                 "since the KV cache is zero-filled RAM sized by this; more rows queue)")
    kv_cache_fraction: Optional[float] = opt(None, "fraction of the GPU memory free when the rollout engine starts "
                                                   "(after the trained model loads) given to the KV cache; null = "
                                                   "what the device budget leaves within "
                                                   "trainer.gpu_memory_utilization")
    offload_weights: Optional[bool] = opt(None, "move the rollout engine's weights to the CPU outside generation "
                                                "(frees a compute-dtype copy of the model for training; re-captures "
                                                "CUDA graphs); null = the device plan decides: on only where the run "
                                                "would not fit without it (off on a CPU)")
    cuda_graphs: bool = opt(True, "capture decode steps in CUDA graphs")
    free_cache_after_generate: bool = opt(True, "free the KV cache after each generation, so training gets its "
                                                "memory (on a GPU; a CPU cache stays allocated); false keeps "
                                                "it allocated through training")
    val_temperature: float = opt(0.0, "sampling temperature for validation (0 = greedy)")
    val_n: int = opt(1, "responses per prompt during validation")
    placement: str = opt("colocate", "colocate: the engine lives in the actor's processes and is fed the weights "
                                     "in place; separate: its own group of processes (and GPUs), fed over "
                                     "torch.distributed after each update", ("colocate", "separate"))
    n_workers: Optional[int] = opt(None, "processes (one per device) of the separate rollout group; "
                                         "null = trainer.n_workers (rollout.placement=separate only)")
    exact: bool = opt(False, "exact on-policy mode: the rollout engine and the trainer's forward run the same "
                             "batch-invariant kernels, so every sampled token's log-prob equals the trainer's bit "
                             "for bit; the old-log-prob pass is skipped (the rollout's are the old log-probs) and "
                             "an update fails if the first forward of the update differs from them at all. Dense "
                             "Llama/Qwen2/Qwen3/Mistral; eager layers (docs/exact.md)")
    quantization: str = opt("none", "fp8: the rollout engine keeps the decoder layers' linear weights in FP8 (e4m3, "
                                    "one scale per output row, requantized at each weight sync) and runs their "
                                    "GEMMs in FP8: about half the weight bytes a decode step reads. CUDA sm_89+ "
                                    "(Ada, Hopper), fast engine, dense models, not with rollout.exact; its log-probs "
                                    "differ more from the trainer's: actor.rollout_correction.mode follows to "
                                    "token_tis when unset (docs/rollout.md#fp8-rollout). Follows to fp8 when unset "
                                    "with model.quantization=nf4 under trainer.device_memory_gib, where it can run "
                                    "(docs/small_gpus.md)", ("none", "fp8"))
    record_routes: bool = opt(False, "mixture of experts: record the experts every token was routed to in each "
                                     "sparse layer (the batch's rollout_routes), for actor.router_replay and the "
                                     "router/* agreement metrics (docs/moe.md); fast engine, single-turn")
    partial: bool = opt(False, "partial rollouts: a step's generation ends once data.train_batch_size prompt groups "
                               "(all rollout.n samples of a prompt) are complete, with more prompts in flight "
                               "(rollout.partial_extra_batches); unfinished samples go on in the next step under "
                               "the new weights, each token recording the policy version that sampled it "
                               "(docs/long_reasoning.md)")
    partial_extra_batches: int = opt(1, "rollout.partial: prompt batches (of data.train_batch_size prompts) kept in "
                                        "flight beyond the one a step trains; the data loader tops them up when "
                                        "groups are dropped. At most rollout.max_staleness with "
                                        "rollout.partial_stale=finish")
    partial_unfinished: str = opt("continue", "rollout.partial: what an unfinished sample does across a step "
                                              "boundary. continue: keeps its KV slot and decodes on under the new "
                                              "weights (needs rollout.free_cache_after_generate=false); recompute: "
                                              "its KV is dropped, and the next step prefills prompt + tokens so far "
                                              "under the new weights", ("continue", "recompute"))
    max_staleness: int = opt(1, "with rollout.partial or rollout.pipeline: the most policy versions a trained "
                                "sample's oldest token may lag the weights it trains; older groups are dropped "
                                "(and counted: rollout/dropped)")
    partial_stale: str = opt("finish", "rollout.partial: a group from an earlier step that the next step would drop "
                                       "as too stale (rollout.max_staleness). finish: this step's generation goes on "
                                       "until it is complete, and trains it (rollout/stale_finished, "
                                       "timing_s/gen_stale_wait); drop: the generation ends without it, and the next "
                                       "step drops it with the work spent on it", ("finish", "drop"))
    pipeline: bool = opt(False, "rollout.placement=separate: the rollout group generates the next step's samples "
                                "while this step scores and trains them (one step off-policy: needs "
                                "rollout.max_staleness >= 1)")


@dataclass
class RolloutCorrectionConfig:
    """Importance weights for the gap between the rollout engine's and the trainer's log-probs."""

    mode: str = opt("none", "weight on each token's policy loss from rho = pi_train/pi_rollout: none; token_tis / "
                            "seq_tis: min(rho, threshold) per token / per sequence; token_mis / seq_mis: rho inside "
                            "[threshold_lower, threshold], the token / sequence dropped outside; decoupled: AReaL's "
                            "decoupled PPO, rho = pi_old/pi_rollout with the old log-probs as proximal policy, tokens "
                            "above threshold dropped, no lower bound",
                    registered("ROLLOUT_CORRECTIONS"))
    threshold: float = opt(2.0, "upper bound C of the importance ratio (truncation point, or upper edge of the "
                                "kept range)")
    threshold_lower: Optional[float] = opt(None, "lower edge of the kept range of the *_mis modes; "
                                                 "null = 1/threshold")


@dataclass
class OptimizedRoleConfig(OptimConfig):
    """Optimisation settings shared by the RL-trained roles (actor, critic)."""

    ppo_epochs: int = opt(1, "passes over each step's batch")


@dataclass
class ActorConfig(OptimizedRoleConfig):
    """The policy being trained, and its frozen reference copy."""

    policy_loss: str = opt("ppo", "policy-gradient loss", registered("POLICY_LOSSES"))
    clip_low: float = opt(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = opt(0.2, "PPO ratio clip above 1 (ratio <= 1 + clip_high); DAPO raises it")
    clip_c: float = opt(3.0, "dual-clip bound for negative advantages")
    kl_loss_coef: float = opt(0.0, "weight of the KL-to-reference loss; 0 = no KL loss (no reference model)")
    kl_loss_type: str = opt("low_var_kl", "KL estimator for the KL loss", registered("KL_KINDS"))
    entropy_coef: float = opt(0.0, "weight of the entropy bonus")
    ref_param_offload: bool = opt(False, "keep the reference model's parameters on the CPU")
    skip_old_log_probs: bool = opt(True, "when each batch gets exactly one optimizer step (ppo_epochs=1, one "
                                         "mini-batch) and no KL in reward, the old log-probs equal the update's "
                                         "own (detached): skip their separate forward pass")
    rollout_correction: RolloutCorrectionConfig = opt(RolloutCorrectionConfig, "training-inference mismatch "
                                                                               "correction")
    router_replay: str = opt("none", "mixture of experts: rollout = the training forwards (log-probs and "
                                     "update) use the experts the rollout engine chose for each token, weighted "
                                     "by the trainer's router (needs rollout.record_routes); none = the "
                                     "trainer's own top-k (docs/moe.md)", ("none", "rollout"))
    router_aux_loss_coef: float = opt(0.0, "mixture of experts: weight of the routers' load-balancing loss "
                                           "(transformers' load_balancing_loss_func) added to the update's "
                                           "loss; 0 = off")


@dataclass
class CriticConfig(OptimizedRoleConfig):
    """The value model (used by the gae estimator)."""

    model: ModelConfig = opt(ModelConfig, "value model; `path` null = start from the actor's model")
    lr: float = opt(1e-5, "peak learning rate")
    cliprange_value: float = opt(0.5, "value clipping range around the old values")
    warmup_steps: int = opt(0, "first trainer steps that update only the critic")


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward."""

    type: str = opt("fixed", "fixed coefficient or adaptive (to a target KL)", ("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "(initial) KL coefficient")
    target_kl: float = opt(0.1, "adaptive: KL the coefficient steers towards")
    horizon: int = opt(10000, "adaptive: steps over which the coefficient adapts")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft penalty for responses close to max_response_length."""

    enable: bool = opt(False, "penalise responses in the last `len` tokens before the limit")
    len: int = opt(64, "buffer length in tokens")
    penalty_factor: float = opt(1.0, "penalty at the limit (linear from 0 at the buffer's start)")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop prompt groups whose samples all score the same."""

    enable: bool = opt(False, "drop groups with zero variance of `metric` and generate more prompt batches until "
                              "data.train_batch_size groups are kept (the surplus is dropped)")
    metric: str = opt("score", "per-sample value compared within a group (score or a reward extra)")
    max_num_gen_batches: int = opt(10, "prompt batches generated per step before giving up; 0 = unlimited")
    allow_partial_batch: bool = opt(False, "when max_num_gen_batches is reached short of data.train_batch_size "
                                           "groups, train on the groups kept (a short step may take fewer "
                                           "optimizer steps) instead of stopping with an error")


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL regularisation."""

    adv_estimator: str = opt("grpo", "advantage estimator", registered("ADV_ESTIMATORS"))
    gamma: float = opt(1.0, "discount factor (gae, reinforce_plus_plus)")
    lam: float = opt(1.0, "GAE lambda")
    norm_adv_by_std: bool = opt(True, "divide group advantages by their std (false = Dr.GRPO)")
    use_kl_in_reward: bool = opt(False, "subtract a KL-to-reference penalty from the token rewards")
    kl_penalty: str = opt("kl", "KL estimator for the in-reward penalty", registered("KL_KINDS"))
    kl_ctrl: KLControlConfig = opt(KLControlConfig, "in-reward KL coefficient control")
    overlong_buffer: OverlongBufferConfig = opt(OverlongBufferConfig, "DAPO overlong penalty")
    filter_groups: FilterGroupsConfig = opt(FilterGroupsConfig, "DAPO group filtering")


@dataclass
class RewardModelConfig:
    """An optional model-based reward (a sequence-classification model)."""

    path: Optional[str] = opt(None, "reward model directory; null = no reward model")
    weight: float = opt(1.0, "weight of its score, added to the function reward")
    micro_batch_size: int = opt(16, "rows per reward-model forward")


@dataclass
class RewardConfig:
    """How responses are scored."""

    function: str = opt("auto", "auto (by data_source), a built-in name, path/to/file.py:function_name or an import "
                                "path (package.module.function, e.g. trl.rewards.accuracy_reward): called by keyword "
                                "with verl's argument names, or once per batch when it takes `completions` or "
                                "`completion_ids` (TRL's batched form); `async def` ones are awaited "
                                "(docs/rewards.md)")
    functions: list[str] = opt([], "several reward functions (specs as for `function`), summed with `weights` "
                                   "(TRL's reward_funcs); [] = `function` alone")
    weights: list[float] = opt([], "one weight per entry of `functions` (TRL's reward_weights); [] = 1 each")
    timeout_s: float = opt(10.0, "per-sample scoring time limit in seconds")
    fallback_score: float = opt(0.0, "score given when the function raises or times out")
    num_workers: int = opt(2, "reward scoring processes; 0 = score in the controller's thread (no timeout; a "
                              "breakpoint() in the reward function works)")
    max_failed_steps: int = opt(3, "stop the run when the reward function fails (raises or times out) on every "
                                   "row, or the environment on every trajectory, of this many training batches in "
                                   "a row (validation does not count); 0 = never")
    reward_model: RewardModelConfig = opt(RewardModelConfig, "model-based reward")
    kwargs: dict[str, Any] = opt({}, "extra keyword arguments passed to the reward function (verl's "
                                     "reward_kwargs); with several functions, to each one that takes them")


@dataclass
class TeacherConfig:
    """On-policy distillation: the per-token reverse KL to a teacher is each sampled token's advantage.

    The teacher scores every token the policy samples (docs/distillation.md)."""

    model: FrozenModelConfig = opt(FrozenModelConfig, "the teacher: a causal LM with the policy's tokenizer (it may be "
                                                      "larger), on the actor's devices; path null = no distillation")
    param_offload: bool = opt(False, "keep the teacher's parameters on the CPU between uses")
    kl_coef: float = opt(1.0, "weight of -(log p_policy - log p_teacher), the negated per-token reverse KL, in each "
                              "sampled token's advantage (0 with teacher.topk > 0: the top-k divergence alone)")
    task_reward: bool = opt(False, "add the task reward's advantages (algorithm.adv_estimator over the scores) to "
                                   "the distillation advantage; false = distillation alone (no critic, any rollout.n)")
    topk: int = opt(0, "k > 0: the teacher also returns its k likeliest tokens at every response position, and the "
                       "update adds teacher.topk_coef x the divergence between that top-k (the rest of the teacher's "
                       "mass one more outcome) and the policy's distribution (teacher/topk_kl; GKD's and TRL's over "
                       "k + 1 outcomes instead of the vocabulary); 0 = the sampled tokens' reverse KL alone")
    topk_coef: float = opt(1.0, "teacher.topk > 0: the weight of the top-k divergence in the actor's loss, aggregated "
                                "over response tokens like the policy loss (actor.loss_agg)")
    topk_beta: float = opt(1.0, "teacher.topk > 0: the divergence, as TRL's DistillationTrainer beta: 1 = KL(policy "
                                "|| teacher), mode-seeking (TRL's default); 0 = KL(teacher || policy), mass-covering; "
                                "between = the generalized Jensen-Shannon divergence")


@dataclass
class RunConfig:
    """The run: length, seed, outputs, backend, validation, checkpoints and logging (every program's)."""

    total_steps: Optional[int] = opt(None, "training steps; null = total_epochs over the training data")
    total_epochs: int = opt(1, "epochs over the training data when total_steps is null")
    seed: int = opt(1, "seed of sampling, shuffling and initialisation")
    output_dir: str = opt("outputs/run", "where metrics, checkpoints and the final model go")
    backend: str = opt("local", "worker processes on this machine, or Ray", ("local", "ray"))
    device: str = opt("auto", "auto = cuda when available", ("auto", "cpu", "cuda"))
    n_workers: int = opt(1, "processes per worker group (one per device)")
    val_every: int = opt(0, "validate every this many steps; 0 = no periodic validation")
    val_before_train: bool = opt(True, "validate once before the first step")
    save_every: int = opt(0, "checkpoint every this many steps; 0 = only at the end")
    keep_checkpoints: int = opt(2, "checkpoints kept on disk (oldest deleted first)")
    resume: str = opt("auto", "auto (latest checkpoint in output_dir), never, or a checkpoint path")
    discard_checkpoints: bool = opt(False, "delete the checkpoints in output_dir this run would mix with (all of "
                                           "them with resume=never; those after the resumed step when resuming "
                                           "an older one) instead of refusing to start")
    loggers: list[str] = opt(["console", "jsonl"], "metric sinks", LOGGERS)
    project_name: str = opt("hybridflow", "project name for TensorBoard / W&B")
    experiment_name: Optional[str] = opt(None, "run name; null = the output_dir's last component")
    log_samples: int = opt(4, "sample completions logged per validation")
    max_bad_steps: int = opt(3, "non-finite steps in a row before the run stops")
    worker_timeout_s: float = opt(30.0, "a worker process silent (no heartbeat) this long while the controller "
                                        "waits on it is reported as unresponsive and the run stops; 0 = wait forever")
    gpu_memory_utilization: float = opt(0.9, "fraction of each GPU's memory the run plans to use (micro-batch "
                                             "token budgets, KV cache); a run that would not fit is refused "
                                             "before training")
    device_memory_gib: Optional[float] = opt(None, "GiB of each GPU the run plans and allocates as if the card had "
                                                   "that much (the allocator is held to it: a 24 GB card proven on "
                                                   "an 80 GB one, two runs sharing a card); replaces "
                                                   "gpu_memory_utilization x the card; null = the whole card "
                                                   "(docs/small_gpus.md)")
    placement: str = opt("colocate", "colocate: actor and critic share each device's process; split: the "
                                     "critic gets its own processes (where the rollout runs is "
                                     "rollout.placement)",
                         ("colocate", "split"))


@dataclass
class TrainerConfig(RunConfig):
    """The run: length, seed, outputs, backend, validation, checkpoints and logging."""

    log_rollouts: int = opt(4, "training rows per step written token by token (log-probs, advantages, turns, "
                               "staleness) to rollouts.jsonl for `hybridflow view`; 0 = none")


@dataclass
class RLConfig:
    """Everything `hybridflow train` reads."""

    model: ModelConfig = opt(ModelConfig, "the policy model (actor, reference, rollout)")
    data: DataConfig = opt(DataConfig, "prompt data")
    rollout: RolloutConfig = opt(RolloutConfig, "generation")
    actor: ActorConfig = opt(ActorConfig, "policy optimisation")
    critic: CriticConfig = opt(CriticConfig, "value model")
    algorithm: AlgorithmConfig = opt(AlgorithmConfig, "advantages and KL")
    reward: RewardConfig = opt(RewardConfig, "scoring")
    teacher: TeacherConfig = opt(TeacherConfig, "on-policy distillation from a teacher model")
    agent: AgentConfig = opt(AgentConfig, "multi-turn episodes: environment and tools")
    trainer: TrainerConfig = opt(TrainerConfig, "the run")
    ray: RayConfig = opt(RayConfig, "Ray cluster and placement (trainer.backend=ray)")
