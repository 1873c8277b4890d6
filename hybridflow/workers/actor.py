"""`ActorWorker`: the policy role — FSDP2 training engine, colocated rollout engine, optional reference.

One process per device holds all three; the controller drives them in the order of an RL step: `generate`
(rollout engine) -> `compute_log_probs` / `compute_ref_log_probs` -> `update_actor` -> `sync_weights` (trained
shards -> rollout engine, in place); the sampling settings and the step come as arguments (`generate(batch,
params, step)`), and the temperature the rows were sampled at comes with each log-prob pass and update. It is
built from one typed `ActorWorker.Config`, resolved on the controller (`hybridflow.trainer.role_configs`).
With `rollout.placement=separate` it is built without a rollout engine and `send_weights` streams the gathered
weights to the `RolloutWorker` group instead (`hybridflow.workers.weight_sync`). With LoRA the
reference is the actor's own model with its adapters disabled (no copy), and a sync sends only the
adapted modules' merged weights (`TrainEngine.rollout_weights`): the rollout engine holds the base model's
others since it loaded them. Memory is handed back and forth: a GPU's KV cache sleeps outside generation
(`free_cache_after_generate`), and with `optimizer_offload` / `param_offload` the optimizer state / parameter
shards stay on the CPU except while they are used, and with `rollout.offload_weights` the rollout engine's
weights too while it sleeps. Given its device's `memory` demand, the worker plans the device first
(`hybridflow.engine.budget`): it refuses a run that cannot fit before loading anything, fills in the micro-
batch token budget, gradient checkpointing and the KV cache that were left to the plan (reported back by
`effective_values`), and reports a CUDA out-of-memory error with the plan and the keys to change. With world
size > 1 each rank runs its own rollout replica on its shard of the prompts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.engine.train.router_replay import RouterHooks
from hybridflow.workers.base import Effective, EngineWorker
from hybridflow.workers.mismatch import RolloutMismatch
from hybridflow.workers.reference_model import ReferenceModel, scoring_temperature
from hybridflow.workers.rollout_calls import RolloutCalls
from hybridflow.workers.rollout_replica import RolloutReplica, pad_token_id
from hybridflow.workers.update import actor_loss
from hybridflow.workers.weight_sync import BUCKET_BYTES, Rendezvous, WeightChannel, drain, plan_buckets


ROLLOUT_MEMORY_KEYS = ("rollout.kv_cache_fraction or trainer.gpu_memory_utilization (a smaller KV cache), "
                       "rollout.max_num_seqs, actor.param_offload=true, actor.optimizer_offload=true, "
                       "trainer.device_memory_gib (higher: more memory)")


class ActorWorker(RolloutCalls, EngineWorker):
    """The actor (and, with `config.reference_copy`, its reference) on this rank; the calls that generate come
    from `RolloutCalls`, on the colocated engine."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What an actor worker is built from, resolved on the controller.

        model / actor: the `model` and `actor` sections.
        rollout: the colocated rollout engine's config; None when a separate rollout group generates.
        reference_copy: hold a frozen reference model (a copy of the initial actor); a LoRA actor's
            reference is its own base weights, so it needs none.
        mini_batch_rows: rows per optimizer step over all ranks (`actor.mini_batch_size x rollout.n`);
            None = the whole batch.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        memory: what this device holds (`hybridflow.trainer.memory.device_demands`); None = no planning.
        seed: seeds the LoRA adapters' initialisation (`trainer.seed`).
        exact_len: exact mode (`rollout.exact`): the trainer's forward runs the rollout engine's batch-invariant
            kernels for rows of at most this many tokens (`data.max_prompt_length + max_response_length`);
            None = off.
        router: a mixture of experts' router hooks on the trainer's forwards (replay of the rollout's recorded
            experts, router agreement, the load-balancing loss); None = none.
        lend_frozen_weights: the colocated rollout engine holds the LoRA model's frozen weights (embeddings, head,
            norms, routers, unadapted experts) as they are instead of copies (`TrainEngine.frozen_weights`).
        topk_coef / topk_beta: the weight of the divergence from the distillation teacher's top-k in the loss, and
            its beta (`teacher.topk_coef`, `teacher.topk_beta` when `teacher.topk` > 0: the batch then carries
            `teacher_topk_*`); 0 = none.
        images: the prompts carry images (`RunFacts.vision`): the actor and its reference load a Qwen3.5
            checkpoint with its vision tower (`TrainEngine`'s `images`).
        """

        model: ModelConfig
        actor: ActorConfig
        rollout: RolloutReplica.Config | None = None
        reference_copy: bool = False
        mini_batch_rows: int | None = None
        total_steps: int = 1
        memory: budget.DeviceDemand | None = None
        seed: int = 0
        exact_len: int | None = None
        router: RouterHooks.Config | None = None
        lend_frozen_weights: bool = False
        topk_coef: float = 0.0
        topk_beta: float = 1.0
        images: bool = False

    keys, model_keys = "actor", "model"
    cfg: ActorConfig

    def __init__(self, config: ActorWorker.Config) -> None:
        model_cfg, actor_cfg = self._plan_device(config.memory, config.model, config.actor)
        self.cfg, self.mini_batch_rows, self.exact = actor_cfg, config.mini_batch_rows, config.exact_len is not None
        self.topk_coef, self.topk_beta = config.topk_coef, config.topk_beta
        # exact mode: the trainer's forward runs the rollout's invariant kernels, for rows as long as it generates
        self.engine = TrainEngine(model_cfg, actor_cfg, head="lm", total_steps=config.total_steps,
                                  device=self.device, seed=config.seed, exact_len=config.exact_len,
                                  router=config.router, images=config.images)
        self.ref = ReferenceModel(model_cfg, actor_cfg, self.device, actor_cfg.ref_param_offload, config.images) \
            if config.reference_copy else None
        self.rollout = None
        if config.rollout is not None:
            # a LoRA actor's frozen weights never change: the engine holds them as they are
            shared = self.engine.frozen_weights() if config.lend_frozen_weights else {}
            replica = dataclasses.replace(config.rollout,
                                          rollout=budget.apply_rollout_plan(self.plan, config.rollout.rollout))
            self.rollout = RolloutReplica(replica, self.device, self.engine.precision.param,
                                          pad_token_id(self.engine.config),
                                          kv_cache_bytes=self.plan.kv_cache_bytes if self.plan else None,
                                          shared_weights=shared, hold_allocator=self._hold_beside,
                                          max_prefill_tokens=self.plan.max_prefill_tokens if self.plan else None)
        self.channel: WeightChannel | None = None
        self.rendezvous: Rendezvous | None = None
        self._offload_idle()

    def _hold_beside(self, outside: int) -> None:
        """The device plan's cap on this process's allocator, less what the KV cache holds outside it."""
        budget.hold_beside(self.plan, self.device, outside)

    @register(Dispatch.BROADCAST)
    def effective_values(self) -> Effective:
        """`EngineWorker.effective_values`, with the colocated rollout engine's."""
        out = super().effective_values()
        if self.rollout is not None:
            out.values.update(self.rollout.effective_values())
        return out

    # ------------------------------------------------------------------ RL-step methods
    @contextlib.contextmanager
    def _generating(self) -> Iterator[RolloutReplica]:
        """The colocated replica, given the device's memory: the parameter shards an update left go first, and
        a CUDA out-of-memory error in generation is reported with the plan and the keys to change."""
        if self.rollout is None:
            raise RuntimeError("this ActorWorker was built without a rollout engine (config.rollout=None); it "
                               "cannot generate (with rollout.placement=separate the RolloutWorker group generates)")
        self._release_params()  # an update not followed by a weight push left them: the KV cache needs the room
        with budget.reported_oom("generation", self.plan, None, ROLLOUT_MEMORY_KEYS):
            yield self.rollout

    @register(Dispatch.DATA_PARALLEL)
    def compute_log_probs(self, batch: Batch, temperature: float) -> Batch:
        """Batch{old_log_probs, entropy} (`[B, R]`) of the current actor, for rows sampled at `temperature`
        (greedy rows scored at 1)."""
        out = self._infer(batch, temperature=scoring_temperature(temperature), with_entropy=True)
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DATA_PARALLEL)
    def compute_ref_log_probs(self, batch: Batch, temperature: float) -> Batch:
        """Batch{ref_log_probs} for rows sampled at `temperature`, from the colocated reference model, or with
        LoRA from the actor's base weights (its adapters disabled for the pass)."""
        temperature = scoring_temperature(temperature)
        if self.engine.adapters is not None:  # the reference routes its tokens itself: no replayed experts
            plain = Batch({k: v for k, v in batch.tensors.items() if k != "rollout_routes"})
            with self.engine.adapters.disabled():
                return Batch({"ref_log_probs": self._infer(plain, temperature=temperature)["log_probs"]})
        if self.ref is None:
            raise RuntimeError("compute_ref_log_probs needs the ActorWorker built with config.reference_copy=True")
        with self._reported_oom("reference log-prob pass"):
            return Batch({"ref_log_probs": self.ref.log_probs(batch, temperature)})

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def update_actor(self, batch: Batch, temperature: float) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches of rows sampled at `temperature`; metrics (identical on all
        ranks) with the field's names, the training–inference mismatch and the rollout correction's
        (`hybridflow.workers.mismatch`)."""
        use_kl = self.cfg.kl_loss_coef > 0
        if use_kl and "ref_log_probs" not in batch:
            raise KeyError("actor.kl_loss_coef > 0 needs `ref_log_probs` in the batch (compute_ref_log_probs)")
        use_entropy = self.cfg.entropy_coef != 0
        if self.topk_coef and "teacher_topk_ids" not in batch:
            raise KeyError("teacher.topk > 0 needs `teacher_topk_ids` in the batch (compute_teacher_log_probs)")
        fresh = None
        if self.exact:  # the update's forwards on the weights that generated are compared
            start = self.engine.optimizer_steps
            fresh = lambda: self.engine.optimizer_steps == start  # noqa: E731
        mismatch = RolloutMismatch(self.cfg.rollout_correction, self.device, fresh)
        # the weight push that follows an update reads the parameter shards: they stay on the device for it
        metrics = self._update(batch, actor_loss(self.cfg, use_kl, use_entropy, mismatch, self.topk_coef),
                               keep_params=True, passes=self.cfg.ppo_epochs, prefix="actor",
                               temperature=scoring_temperature(temperature),
                               with_entropy=use_entropy or "entropy" not in batch,
                               soft_targets=self.topk_beta if self.topk_coef else None)
        metrics.update(mismatch.metrics())
        mismatch.check(metrics)
        metrics.update(self.engine.router_metrics())
        if not use_entropy and "entropy" in batch:  # the token mean over every rank's rows
            mask = batch["response_mask"]
            summed = all_reduce(torch.stack([(batch["entropy"] * mask).sum(), mask.sum()]), self.device)
            metrics["actor/entropy"] = float(summed[0] / summed[1].clamp(min=1))
        return metrics

    # ------------------------------------------------------------------ weight sync
    def _with_rollout_weights(self, consume: Callable[[Iterator], Any]) -> dict[str, float]:
        """`consume`s the weights the rollout engine needs (`TrainEngine.rollout_weights`), gathered one at
        a time and cast to the rollout dtype (a collective: every rank calls it); returns
        `timing_s/update_weights`."""
        start = time.perf_counter()
        self._onload(optimizer=False)  # nothing to move when the update before it kept the shards
        consume(self.engine.rollout_weights(dtype=self.engine.precision.param))
        self._offload_idle(optimizer=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"timing_s/update_weights": time.perf_counter() - start}

    @register(Dispatch.BROADCAST)
    def sync_weights(self) -> dict[str, float]:
        """Trained shards (with LoRA the merged adapted weights) -> the colocated rollout engine's weights, in
        place; returns `timing_s/update_weights`."""
        if self.rollout is None:
            raise RuntimeError("this ActorWorker has no rollout engine (config.rollout=None); with "
                               "rollout.placement=separate the weights go out by send_weights")
        return self._with_rollout_weights(self.rollout.load_weights)

    @register(Dispatch.RANK_ZERO)
    def open_weight_sync(self) -> tuple[str, int]:
        """Rank 0 hosts the weight-sync group's store on its own node; returns its (host, port) for
        `join_weight_sync` on both groups."""
        self.rendezvous = Rendezvous(self.host)
        return self.rendezvous.host, self.rendezvous.port

    @register(Dispatch.BROADCAST)
    def join_weight_sync(self, host: str, port: int, world_size: int,
                         bucket_bytes: int = BUCKET_BYTES) -> None:
        """Rank 0 joins the weight-sync group at `host:port` as its sender (rank 0 of `world_size`) and
        publishes the bucket plan; the other ranks only gather in `send_weights`. Runs concurrently with
        the rollout group's `join_weight_sync`."""
        if self.rank == 0:
            self.channel = WeightChannel(host, port, 0, world_size, self.device)
            shapes = self.engine.rollout_weight_shapes()
            self.channel.publish_plan(plan_buckets(shapes, self.engine.precision.param, bucket_bytes),
                                      self.engine.precision.param)

    @register(Dispatch.BROADCAST)
    def send_weights(self) -> dict[str, float]:
        """Trained shards (with LoRA the merged adapted weights) -> the separate rollout group, bucket by bucket
        from rank 0 (every rank gathers);
        runs concurrently with the rollout group's `receive_weights`; returns `timing_s/update_weights`."""
        if self.rank != 0:
            return self._with_rollout_weights(drain)
        if self.channel is None:
            raise RuntimeError("send_weights needs join_weight_sync first (rollout.placement=separate)")
        return self._with_rollout_weights(self.channel.send)
