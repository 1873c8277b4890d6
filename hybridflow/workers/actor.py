"""`ActorWorker`: the policy role — FSDP2 training engine, colocated rollout engine, optional reference.

One process per device holds all three; the controller drives them in the order of an RL step:
`generate` (rollout engine) -> `compute_log_probs` / `compute_ref_log_probs` -> `update_actor` ->
`sync_weights` (trained shards -> rollout engine, in place). With `rollout.placement=separate` it is built
without a rollout engine and `send_weights` streams the gathered weights to the `RolloutWorker` group
instead (`hybridflow.workers.weight_sync`). With LoRA (`actor.lora.rank` > 0) the reference is the actor's
own model with its adapters disabled (no copy), and a sync sends only the adapted modules' merged weights
(`TrainEngine.rollout_weights`): the rollout engine holds the base model's others since it loaded them.
Memory is handed back and forth: a GPU's
KV cache sleeps outside generation (`free_cache_after_generate`), and with `optimizer_offload` /
`param_offload` the optimizer state / parameter shards stay on the CPU except while they are used, and
with `rollout.offload_weights` the rollout engine's weights too while it sleeps. Given its device's
`memory` demand, the worker plans the device first (`hybridflow.engine.budget`): it refuses a run that
cannot fit before loading anything, fills in the micro-batch token budget, gradient checkpointing and the
KV cache that were left to the plan, and reports a CUDA out-of-memory error with the plan and the keys to
change. With world size > 1 each rank runs its own rollout replica on its shard of the prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.mismatch import RolloutMismatch
from hybridflow.workers.reference import ReferenceModel, temperature_of
from hybridflow.workers.rollout_replica import RolloutReplica, pad_token_id
from hybridflow.workers.update import actor_loss
from hybridflow.workers.weight_sync import BUCKET_BYTES, Rendezvous, WeightChannel, drain, plan_buckets


ROLLOUT_MEMORY_KEYS = ("rollout.kv_cache_fraction or trainer.gpu_memory_utilization (a smaller KV cache), "
                       "rollout.max_num_seqs, actor.param_offload=true, actor.optimizer_offload=true")


class ActorWorker(EngineWorker):
    """The actor (and, with `with_ref`, its reference) on this rank.

    Args:
        model_cfg, actor_cfg, rollout_cfg: the config sections (read by attribute).
        data_cfg: anything with `max_prompt_length` and `max_response_length`.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        with_ref: also hold a frozen reference model (a copy of the initial actor; with LoRA the base
            model under the adapters serves, and nothing more is held).
        with_rollout: build the rollout engine (False when a separate rollout group generates).
        memory: what this device holds (`hybridflow.trainer.memory.device_demands`); None = no planning.
        agent_cfg: the `agent` config section (multi-turn episodes when it sets an environment or tools).
        seed: seeds the LoRA adapters' initialisation (`trainer.seed`).
    """

    keys, model_keys = "actor", "model"

    def __init__(self, model_cfg: Any, actor_cfg: Any, rollout_cfg: Any, data_cfg: Any, total_steps: int = 1,
                 with_ref: bool = False, with_rollout: bool = True, memory: budget.DeviceDemand | None = None,
                 agent_cfg: Any = None, seed: int = 0) -> None:
        model_cfg, actor_cfg = self._plan_device(memory, model_cfg, actor_cfg)
        if self.plan is not None and self.rank == 0:
            print(f"device plan: {self.plan.describe()}", flush=True)
        self.cfg, self.rollout_cfg = actor_cfg, rollout_cfg
        # exact mode: the trainer's forward runs the rollout's invariant kernels, for rows as long as it generates
        exact_len = data_cfg.max_prompt_length + data_cfg.max_response_length if rollout_cfg.exact else None
        self.engine = TrainEngine(model_cfg, actor_cfg, head="lm", total_steps=total_steps, device=self.device,
                                  seed=seed, exact_len=exact_len)
        self.ref = ReferenceModel(model_cfg, actor_cfg, self.device) \
            if with_ref and self.engine.adapters is None else None
        self.rollout = None
        if with_rollout:
            self.rollout = RolloutReplica(model_cfg.path, rollout_cfg, data_cfg, self.device,
                                          self.engine.precision.param, pad_token_id(self.engine.config),
                                          kv_cache_bytes=self.plan.kv_cache_bytes if self.plan else None,
                                          agent_cfg=agent_cfg, tokenizer_path=model_cfg.tokenizer_path)
        self.channel: WeightChannel | None = None
        self.rendezvous: Rendezvous | None = None
        self._offload_idle()

    # ------------------------------------------------------------------ RL-step methods
    @register(Dispatch.DATA_PARALLEL)
    def generate(self, batch: Batch) -> Batch:
        """Prompts -> rows of the RL batch, `n` samples per prompt interleaved (see `RolloutReplica.generate`)."""
        if self.rollout is None:
            raise RuntimeError("this ActorWorker was built with with_rollout=False; it cannot generate "
                               "(with rollout.placement=separate the RolloutWorker group generates)")
        self._release_params()  # an update not followed by a weight push left them: the KV cache needs the room
        with budget.reported_oom("generation", self.plan, None, ROLLOUT_MEMORY_KEYS):
            return self.rollout.generate(batch, self.rank)

    @register(Dispatch.DATA_PARALLEL)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Batch{old_log_probs, entropy} (`[B, R]`) of the current actor at the sampling temperature."""
        out = self._infer(batch, temperature=temperature_of(batch, self.rollout_cfg.temperature), with_entropy=True)
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DATA_PARALLEL)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """Batch{ref_log_probs} from the colocated reference model, or with LoRA from the actor's base weights
        (its adapters disabled for the pass)."""
        temperature = temperature_of(batch, self.rollout_cfg.temperature)
        if self.engine.adapters is not None:
            with self.engine.adapters.disabled():
                return Batch({"ref_log_probs": self._infer(batch, temperature=temperature)["log_probs"]})
        if self.ref is None:
            raise RuntimeError("compute_ref_log_probs needs the ActorWorker built with with_ref=True")
        with self._reported_oom("reference log-prob pass"):
            return self.ref.log_probs(batch, temperature)

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; metrics (identical on all ranks) with the field's names,
        the training–inference mismatch and the rollout correction's (`hybridflow.workers.mismatch`)."""
        use_kl = self.cfg.kl_loss_coef > 0
        if use_kl and "ref_log_probs" not in batch:
            raise KeyError("actor.kl_loss_coef > 0 needs `ref_log_probs` in the batch (compute_ref_log_probs)")
        use_entropy = self.cfg.entropy_coef != 0
        fresh = None
        if self.rollout_cfg.exact:  # the update's forwards on the weights that generated are compared
            start = self.engine.optimizer_steps
            fresh = lambda: self.engine.optimizer_steps == start  # noqa: E731
        mismatch = RolloutMismatch(self.cfg.rollout_correction, self.device, fresh)
        # the weight push that follows an update reads the parameter shards: they stay on the device for it
        metrics = self._update(batch, actor_loss(self.cfg, use_kl, use_entropy, mismatch), keep_params=True,
                               passes=self.cfg.ppo_epochs, prefix="actor", rollout_n=self.rollout_cfg.n,
                               temperature=temperature_of(batch, self.rollout_cfg.temperature),
                               with_entropy=use_entropy or "entropy" not in batch)
        metrics.update(mismatch.metrics())
        mismatch.check(metrics)
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
            raise RuntimeError("this ActorWorker has no rollout engine (with_rollout=False); with "
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
        if self.rank == 0 and self.channel is None:
            raise RuntimeError("send_weights needs join_weight_sync first (rollout.placement=separate)")
        return self._with_rollout_weights(self.channel.send if self.rank == 0 else drain)
