"""`RLTrainer`: the PPO-family controller loop behind `hybridflow train`.

    hybridflow train --config recipes/grpo.yaml model.path=MODEL_DIR data.train_files=train.parquet

One step reads like the algorithm: generate n responses per prompt → score them (in a process pool,
overlapped with the log-prob passes) → old and reference log-probs → values → advantages → critic
update → actor update → weight sync into the rollout engine (in place, or over torch.distributed to a
separate rollout group: `hybridflow.trainer.roles`). Each arrow is a worker-group call or a
pure function of `hybridflow.trainer.core`; nothing here touches devices or process groups.
"""

from __future__ import annotations

import time
from typing import Any

from hybridflow import algorithms
from hybridflow.batch import Batch
from hybridflow.config.validate import needs_reference, validate
from hybridflow.data.loader import BatchLoader, build_prompt_loaders
from hybridflow.rewards.manager import RewardManager
from hybridflow.tracking.metrics import (compute_data_metrics, compute_throughput, compute_timing_metrics,
                                         compute_validation_metrics, timer)
from hybridflow.trainer import core
from hybridflow.trainer.base import Trainer
from hybridflow.trainer.checkpointing import checkpoint_bytes_needed
from hybridflow.trainer.roles import build_roles, skips_old_log_probs


class RLTrainer(Trainer):
    """Builds everything a run needs from an `RLConfig` (the common parts in `Trainer`), then `fit()` trains."""

    model_role = "actor"

    def __init__(self, cfg: Any) -> None:
        validate(cfg)
        super().__init__(cfg, checkpoint_bytes_needed(cfg))
        if self.step:  # the rollout engines were built from model.path: give them the resumed weights
            self.roles.sync_weights()

    def build_loaders(self) -> tuple[BatchLoader, BatchLoader | None]:
        return build_prompt_loaders(self.cfg, self.tokenizer)

    def start_workers(self) -> None:
        """The reward function's pool (checked against the datasets' data sources first), the KL
        controller and the role groups (`hybridflow.trainer.roles`)."""
        cfg = self.cfg
        self.rewards = RewardManager(cfg.reward.function, cfg.reward.num_workers, cfg.reward.timeout_s,
                                     cfg.reward.fallback_score, cfg.reward.kwargs)
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                ds = loader.dataset
                self.rewards.check_data_sources({ds[i]["data_source"] for i in range(len(ds))})
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algorithms.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.roles = build_roles(cfg, self.total_steps)
        self.groups = self.roles.groups

    def checkpointed_roles(self) -> dict[str, Any]:
        roles: dict[str, Any] = {"actor": self.roles.actor}
        if self.roles.critic is not None:
            roles["critic"] = self.roles.critic
        return roles

    def checkpointed_state(self) -> dict[str, Any]:
        return {**super().checkpointed_state(), "kl_ctrl": self.kl_ctrl}

    # ------------------------------------------------------------------ the loop
    def train_step(self, prompts: Batch) -> dict[str, float]:
        """One RL iteration on a batch of prompts; returns its metrics."""
        cfg, actor, critic, rollout = self.cfg, self.roles.actor, self.roles.critic, self.roles.rollout
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timings):
            prompts.meta.update(sampling={"seed": cfg.trainer.seed}, step=self.step)
            with timer("gen", timings):
                batch = rollout.generate(prompts)
            batch["response_text"] = core.decode_responses(batch, self.tokenizer)
            scoring = self.submit_scoring(batch)
            if not skips_old_log_probs(cfg):
                with timer("old_log_prob", timings):
                    batch = batch.union(actor.compute_log_probs(batch))
            if needs_reference(cfg):
                with timer("ref", timings):
                    batch = batch.union(actor.compute_ref_log_probs(batch))
            if critic is not None:
                with timer("values", timings):
                    batch = batch.union(critic.compute_values(batch))
            with timer("reward", timings):
                metrics.update(core.apply_scores(batch, scoring(), cfg))
            if cfg.algorithm.filter_groups.enable:
                batch, kept = core.group_filter(batch, cfg.algorithm.filter_groups.metric)
                metrics.update(kept)
            with timer("adv", timings):
                metrics.update(core.apply_kl_in_reward(batch, self.kl_ctrl, cfg))
                core.compute_advantages(batch, cfg)
            if critic is not None:
                with timer("update_critic", timings):
                    metrics.update(critic.update_critic(batch))
            if critic is None or self.step >= cfg.critic.warmup_steps:
                with timer("update_actor", timings):
                    metrics.update(actor.update_actor(batch))
                with timer("update_weights", timings):
                    self.roles.sync_weights()
        metrics.update(compute_data_metrics(batch, cfg.data.max_response_length))
        metrics.update(compute_timing_metrics(timings, batch))
        metrics.update(compute_throughput(batch, timings["step"], self.n_devices))
        self.bad_steps.update(self.step + 1, **{k: v for k, v in metrics.items()
                                                if k in ("actor/grad_norm", "actor/pg_loss", "critic/vf_loss")})
        return metrics

    def submit_scoring(self, batch: Batch):
        """Starts scoring `batch` (reward function in its pool, reward model on its workers) and returns
        a callable that waits for the combined `RewardResult`."""
        function = self.rewards.submit(batch)
        model = self.roles.reward_model.score.submit(batch) if self.roles.reward_model is not None else None

        def result():
            rm_scores = model.result()["rm_scores"] if model is not None else None
            return core.with_model_scores(function.result(), rm_scores, self.cfg.reward.reward_model.weight)

        return result

    def validate(self) -> dict[str, float]:
        """Greedy (by default) generation on the validation prompts; `val/...` scores per data source."""
        cfg = self.cfg
        sources, scores, samples = [], [], []
        start = time.perf_counter()
        for prompts in self.val_loader:
            prompts.meta["sampling"] = {"n": cfg.rollout.val_n, "temperature": cfg.rollout.val_temperature,
                                        "seed": cfg.trainer.seed}
            batch = self.roles.rollout.generate(prompts)
            batch["response_text"] = core.decode_responses(batch, self.tokenizer)
            result = self.submit_scoring(batch)()
            batch["score"] = list(result.scores)
            sources += [str(s) for s in batch["data_source"]]
            scores += list(result.scores)
            if len(samples) < cfg.trainer.log_samples:
                texts = self.tokenizer.batch_decode(batch["prompts"], skip_special_tokens=False)
                texts = [t.replace(self.tokenizer.pad_token or "", "") for t in texts]
                samples += core.sample_rows(batch, list(batch["response_text"]), texts,
                                            cfg.trainer.log_samples - len(samples))
        self.tracker.log_samples(samples, self.step)
        metrics = compute_validation_metrics(sources, scores)
        metrics["timing_s/val"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        """Stops the workers and the reward pool, flushes the loggers (safe to call twice)."""
        super().close()
        self.rewards.close()


def train(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow train` for a loaded `RLConfig`; returns the last step's metrics."""
    return RLTrainer(cfg).fit()
