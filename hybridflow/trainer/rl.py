"""`RLTrainer`: the PPO-family controller loop behind `hybridflow train`.

    hybridflow train --config recipes/grpo.yaml model.path=MODEL_DIR data.train_files=train.parquet

One step reads like the algorithm: generate n responses per prompt (multi-turn episodes with an
environment or tools when `agent` sets them: `hybridflow.agents`; with partial rollouts, take the prompt groups
that are complete, and with the pipelined separate rollout, the rows generated during the step before:
`hybridflow.trainer.rollout_stream`) → score them (in a process pool, overlapped with the log-prob passes) →
old and reference log-probs (and a distillation teacher's) → values → advantages → critic update → actor
update → weight sync into the rollout engine (in place, or over torch.distributed to a separate rollout group:
`hybridflow.trainer.role_groups`). In exact mode (`rollout.exact`) the rollout's log-probs are the old ones and
that pass is skipped. Each arrow is a worker-group call or a
pure function of `hybridflow.trainer.step_math`; nothing here touches devices or process groups.
Two algorithms add to the first arrows: ReMax generates one greedy response per prompt beside the
samples, whose score is the prompt's baseline (`submit_baselines`); DAPO's dynamic sampling generates and
scores more prompt batches until `data.train_batch_size` groups with differing scores are kept
(`sample_varied_groups`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from hybridflow import algorithms
from hybridflow.agents.loop.host import tool_schemas
from hybridflow.batch import Batch
from hybridflow.config.resolved import resolve_facts
from hybridflow.config.validate import ConfigError, validate
from hybridflow.controller import submit
from hybridflow.data.files import DataError
from hybridflow.data.loader import BatchLoader, build_prompt_loaders
from hybridflow.rewards.failures import EnvironmentFailed, FailureStreak
from hybridflow.rewards.manager import RewardManager, RewardResult
from hybridflow.tracking.metrics import (compute_agent_metrics, compute_data_metrics, compute_throughput,
                                         compute_timing_metrics, compute_validation_metrics, timer)
from hybridflow.tracking.rollout_records import rollout_records
from hybridflow.trainer import step_math
from hybridflow.trainer.base import Trainer
from hybridflow.trainer.checkpointing import checkpoint_bytes_needed
from hybridflow.trainer.role_configs import train_sampling
from hybridflow.trainer.role_groups import Roles, build_roles
from hybridflow.trainer.rollout_stream import RolloutStream, policy_version
from hybridflow.workers.handles import TrainedRoleHandle

logger = logging.getLogger(__name__)


class RLTrainer(Trainer):
    """Builds everything a run needs from an `RLConfig` (the common parts in `Trainer`), then `fit()` trains.
    The facts the config implies are resolved once (`facts`: `hybridflow.config.resolved.RunFacts`), and so
    are the sampling settings of a training step (`sampling`), passed to every `generate` call."""

    model_role = "actor"
    roles: Roles

    def __init__(self, cfg: Any) -> None:
        validate(cfg)
        self.facts = resolve_facts(cfg)
        self.sampling = train_sampling(cfg)
        self.rewards: RewardManager | None = None
        super().__init__(cfg)
        # the rollout engines were built from model.path: give them the resumed weights, or a 4-bit base's
        # dequantized ones (the policy the trainer computes with differs from the directory's bf16 weights)
        if self.step or cfg.model.quantization != "none":
            self.roles.sync_weights()

    @classmethod
    def checkpoint_size(cls, cfg: Any) -> int:
        return checkpoint_bytes_needed(cfg)

    @classmethod
    def lora_bases(cls, cfg: Any) -> dict[str, str]:
        facts = resolve_facts(cfg)
        bases: dict[str, str] = {}
        if facts.actor_lora:
            bases["actor"] = cfg.model.path
        if facts.critic and facts.critic_lora:
            bases["critic"] = cfg.critic.model.path or cfg.model.path
        return bases

    @classmethod
    def build_loaders(cls, cfg: Any, tokenizer: Any) -> tuple[BatchLoader, BatchLoader | None]:
        tools = tool_schemas(cfg.agent) or None  # shown in every prompt of a tool-calling run
        return build_prompt_loaders(cfg, tokenizer, tools)

    @classmethod
    def check_data(cls, cfg: Any, train: BatchLoader, val: BatchLoader | None) -> None:
        """The reward functions' inputs against each dataset (`check_reward_inputs`), with a manager that starts
        no scoring process."""
        rewards = RewardManager.from_config(cfg.reward, num_workers=0)
        for loader in (train, val):
            if loader is not None:
                check_reward_inputs(rewards, loader.dataset)

    def start_workers(self) -> None:
        """The reward function's pool, the KL controller and the role groups (`hybridflow.trainer.role_groups`)."""
        cfg = self.cfg
        self.rewards = RewardManager.from_config(cfg.reward)
        self.env_failures = FailureStreak(f"environment {cfg.agent.environment!r}", cfg.reward.max_failed_steps,
                                          EnvironmentFailed, "trajectory")
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algorithms.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.roles = build_roles(cfg, self.total_steps, self.facts)
        self.groups = self.roles.groups
        self.stream = RolloutStream(cfg, self.facts, self.sampling, self.roles.rollout, self.train_loader,
                                    self.train_loader.dataset.pad_token_id)

    def checkpointed_roles(self) -> dict[str, TrainedRoleHandle]:
        roles: dict[str, TrainedRoleHandle] = {"actor": self.roles.actor}
        if self.roles.critic is not None:
            roles["critic"] = self.roles.critic
        return roles

    def effective_handles(self) -> dict[str, Any]:
        """The trained roles, the distillation teacher and, with `rollout.placement=separate`, the rollout group."""
        handles = super().effective_handles()
        if self.roles.teacher is not None:
            handles["teacher"] = self.roles.teacher
        if self.roles.separate is not None:
            handles["rollout"] = self.roles.separate.group
        return handles

    def checkpointed_state(self) -> dict[str, Any]:
        state = {**super().checkpointed_state(), "kl_ctrl": self.kl_ctrl}
        if self.facts.off_policy:  # what is in flight (partial rollouts, the pipelined next batch)
            state["rollouts"] = self.stream
        return state

    # ------------------------------------------------------------------ the loop
    def train_step(self, prompts: Batch) -> dict[str, float]:
        """One RL iteration on a batch of prompts (more with dynamic sampling); returns its metrics."""
        cfg, facts, actor, critic = self.cfg, self.facts, self.roles.actor, self.roles.critic
        temperature = self.sampling.temperature  # what the rows were sampled at: their log-probs are taken at it
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timings):
            if cfg.algorithm.filter_groups.enable:
                prompts, batch = self.sample_varied_groups(prompts, timings, metrics)
                scoring = None
            else:
                batch = self.generate(prompts, timings, metrics)
                scoring = self.submit_scoring(batch)
            baselines = self.submit_baselines(prompts, timings) if facts.greedy_baseline else None
            if cfg.rollout.exact:  # the rollout's log-probs are the trainer's, bit for bit (docs/exact.md)
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif not facts.skip_old_log_probs:
                with timer("old_log_prob", timings):
                    batch = batch.union(actor.compute_log_probs(batch, temperature))
            if facts.reference:
                with timer("ref", timings):
                    batch = batch.union(actor.compute_ref_log_probs(batch, temperature))
            if self.roles.teacher is not None:
                with timer("teacher", timings):
                    batch = batch.union(self.roles.teacher.compute_teacher_log_probs(batch, temperature))
            if critic is not None:
                with timer("values", timings):
                    batch = batch.union(critic.compute_values(batch))
            with timer("reward", timings):
                if scoring is not None:
                    metrics.update(step_math.apply_scores(batch, scoring(), cfg))
                if baselines is not None:
                    greedy, greedy_result = baselines()
                    metrics.update(step_math.apply_baselines(batch, greedy, greedy_result, cfg))
            with timer("adv", timings):
                metrics.update(step_math.apply_kl_in_reward(batch, self.kl_ctrl, cfg))
                metrics.update(step_math.compute_advantages(batch, cfg, facts))
            if critic is not None:
                with timer("update_critic", timings):
                    metrics.update(critic.update_critic(batch))
            if critic is None or self.step >= cfg.critic.warmup_steps:
                with timer("update_actor", timings):
                    metrics.update(actor.update_actor(batch, temperature))
                with timer("update_weights", timings):
                    self.roles.sync_weights()
        metrics.update(compute_data_metrics(batch, cfg.data.max_response_length))
        metrics.update(compute_agent_metrics(batch))
        metrics.update(compute_timing_metrics(timings, batch))
        metrics.update(compute_throughput(batch, timings["step"], self.n_devices))
        if cfg.trainer.log_rollouts and self.tracker is not None:  # token by token, for `hybridflow view`
            version = policy_version(facts, cfg.critic.warmup_steps, self.step)
            self.tracker.log_rollouts(rollout_records(batch, self.tokenizer, cfg.trainer.log_rollouts, version),
                                      self.step + 1)
        self.bad_steps.update(self.step + 1, **{k: v for k, v in metrics.items()
                                                if k in ("actor/grad_norm", "actor/pg_loss", "critic/vf_loss")})
        return metrics

    def generate(self, prompts: Batch, timings: dict[str, float], metrics: dict[str, float]) -> Batch:
        """This step's rows for `prompts`, the batch the train loader served last (`response_text` decoded):
        `rollout.n` responses to each, or with partial rollouts the complete groups taken from those in
        flight (`RolloutStream`, which also says how the sampling seed follows the prompt batches). The
        generation's metrics go into `metrics`."""
        with timer("gen", timings):
            batch, generated = self.stream.next_batch(prompts, self.step)
            batch = step_math.drop_failed_trajectories(batch)
        metrics.update(generated)
        batch["response_text"] = step_math.decode_responses(batch, self.tokenizer)
        if "agent/env_error" in batch:
            self.env_failures.update(list(batch["agent/env_error"]))
        return batch

    def sample_varied_groups(self, prompts: Batch, timings: dict[str, float],
                             metrics: dict[str, float]) -> tuple[Batch, Batch]:
        """DAPO's dynamic sampling: generates and scores prompt batches (the first is `prompts`, the next ones
        come from the train loader) until `data.train_batch_size` groups whose `filter_groups.metric` varies
        are kept, then returns exactly that many (prompts, and their scored rows), the surplus dropped.
        After `filter_groups.max_num_gen_batches` batches (0: no limit) it stops with an error, or, with
        `filter_groups.allow_partial_batch`, returns the groups kept. Adds `filter_groups/num_gen_batches`,
        `filter_groups/kept_ratio` (kept groups / generated groups) and the rounds' reward metrics."""
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        want, n = cfg.data.train_batch_size, cfg.rollout.n
        kept_prompts: list[Batch] = []
        kept_rows: list[Batch] = []
        rounds: list[dict[str, float]] = []
        kept = 0
        while kept < want:
            if rounds:
                if fg.max_num_gen_batches and len(rounds) >= fg.max_num_gen_batches:
                    if fg.allow_partial_batch and kept:
                        break
                    raise RuntimeError(dynamic_sampling_failure(cfg, kept, len(rounds)))
                prompts = self.train_loader.next_batch()
            batch = self.generate(prompts, timings, metrics)
            with timer("reward", timings):
                rounds.append(step_math.apply_scores(batch, self.submit_scoring(batch)(), cfg))
            rows = step_math.varied_groups(batch, fg.metric)
            kept_rows.append(batch[rows])
            kept_uids = set(batch[rows]["uid"])  # a prompt is kept with its group (failed trajectories are gone)
            kept_prompts.append(prompts[torch.tensor([uid in kept_uids for uid in prompts["uid"]])])
            kept += len(kept_prompts[-1])
        pad_id = self.train_loader.dataset.pad_token_id
        metrics.update(step_math.merge_round_metrics(rounds))
        metrics.update({"filter_groups/num_gen_batches": float(len(rounds)),
                        "filter_groups/kept_ratio": kept / (len(rounds) * want)})
        return (step_math.concat_rounds(kept_prompts, pad_id)[:want],
                step_math.concat_rounds(kept_rows, pad_id)[:want * n])

    def submit_baselines(self, prompts: Batch, timings: dict[str, float]
                         ) -> Callable[[], tuple[Batch, RewardResult]]:
        """ReMax: one greedy (temperature 0) response per prompt, generated now and scored in the background
        like the samples; returns a callable that waits for `(greedy batch, its RewardResult)`."""
        with timer("gen_baseline", timings):
            greedy = self.roles.rollout.generate(prompts, replace(self.sampling, n=1, temperature=0.0, seed=None))
        greedy["response_text"] = step_math.decode_responses(greedy, self.tokenizer)
        scoring = self.submit_scoring(greedy)
        return lambda: (greedy, scoring())

    def submit_scoring(self, batch: Batch, counted: bool = True) -> Callable[[], RewardResult]:
        """Starts scoring `batch` (reward function in its pool, reward model on its workers) and returns
        a callable that waits for the combined `RewardResult`. `counted`: a training batch, which counts
        towards `reward.max_failed_steps` (validation batches do not)."""
        if self.rewards is None:
            raise RuntimeError("submit_scoring needs the reward pool start_workers builds")
        function = self.rewards.submit(batch, counted)
        model = submit(self.roles.reward_model.score, batch) if self.roles.reward_model is not None else None

        def result() -> RewardResult:
            rm_scores = model.result()["rm_scores"] if model is not None else None
            return step_math.with_model_scores(function.result(), rm_scores, self.cfg.reward.reward_model.weight)

        return result

    def validate(self) -> dict[str, float]:
        """Greedy (by default) generation on the validation prompts; `val/...` scores per data source."""
        cfg = self.cfg
        sources: list[str] = []
        scores: list[float] = []
        samples: list[dict[str, Any]] = []
        start = time.perf_counter()
        params = replace(self.sampling, n=cfg.rollout.val_n, temperature=cfg.rollout.val_temperature)
        for prompts in self.validation_batches():
            batch = self.roles.rollout.generate(prompts, params)
            batch["response_text"] = step_math.decode_responses(batch, self.tokenizer)
            result = self.submit_scoring(batch, counted=False)()
            batch["score"] = list(result.scores)
            sources += [str(s) for s in batch["data_source"]]
            scores += list(result.scores)
            if len(samples) < cfg.trainer.log_samples:
                texts = self.tokenizer.batch_decode(batch["prompts"], skip_special_tokens=False)
                texts = [t.replace(self.tokenizer.pad_token or "", "") for t in texts]
                samples += step_math.sample_rows(batch, list(batch["response_text"]), texts,
                                            cfg.trainer.log_samples - len(samples))
        if self.tracker is not None:  # None while the trainer is still being built
            self.tracker.log_samples(samples, self.step)
        metrics = compute_validation_metrics(sources, scores)
        metrics["timing_s/val"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        """Stops the workers and the reward pool, flushes the loggers (safe to call twice)."""
        super().close()
        if self.rewards is not None:
            self.rewards.close()


def check_reward_inputs(rewards: RewardManager, dataset: Any) -> None:
    """Before any model loads, what the reward functions need from a dataset (an `RLDataset`): a built-in for
    each data source with ``auto`` (an error names the first row with it), a column for each parameter of a
    batched function, and a warning when a function names `ground_truth` but no row has one."""
    for source, where in dataset.sources.items():
        try:
            rewards.check_data_sources([source])
        except ValueError as e:
            raise DataError(f"{where}, column 'data_source': {e}") from None
        except ImportError as e:
            raise ConfigError(f"{where}: {e}") from None
    rows = [dataset[i] for i in range(len(dataset))]
    columns = {k for row in rows for k in row["columns"]}
    missing = rewards.scorer.missing_columns(sorted(columns))
    if missing:
        raise ConfigError(f"reward function parameters {missing} name no column of {', '.join(dataset.files)} "
                          f"(columns: {', '.join(sorted(columns))}); a batched function gets prompts, completions, "
                          f"completion_ids and the dataset's columns")
    if rewards.scorer.names("ground_truth") and all(row["ground_truth"] is None for row in rows):
        held = sorted({k for row in rows for k in (row["columns"].get("reward_model") or {})})
        logger.warning("%s: no row has a ground truth (reward_model.ground_truth or a ground_truth column)%s, but "
                       "reward function %s reads ground_truth: it gets None on every row", ", ".join(dataset.files),
                       f"; reward_model holds {held}" if held else "", rewards.spec.label())


def dynamic_sampling_failure(cfg: Any, kept: int, rounds: int) -> str:
    """What to change when dynamic sampling ran out of prompt batches short of a full batch."""
    fg, want = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    partial = ("" if fg.allow_partial_batch else
               ", or set algorithm.filter_groups.allow_partial_batch=true to train on the groups kept")
    return (f"dynamic sampling (algorithm.filter_groups) kept {kept} of the data.train_batch_size={want} prompt "
            f"groups it needs after {rounds} prompt batches (algorithm.filter_groups.max_num_gen_batches="
            f"{fg.max_num_gen_batches}): the other {rounds * want - kept} groups' {cfg.rollout.n} responses all had "
            f"the same {fg.metric}. Raise algorithm.filter_groups.max_num_gen_batches (0 = no limit), make "
            f"responses differ more (a larger rollout.n or rollout.temperature), use prompts that are neither "
            f"always solved nor never{partial}")


def train(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow train` for a loaded `RLConfig`; returns the last step's metrics."""
    return RLTrainer(cfg).fit()
