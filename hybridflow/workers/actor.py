"""`ActorWorker`: the policy role — FSDP2 training engine, colocated rollout engine, optional reference.

One process per device holds all three; the controller drives them in the order of an RL step:
`generate` (rollout engine) -> `compute_log_probs` / `compute_ref_log_probs` -> `update_actor` ->
`sync_weights` (trained shards -> rollout engine, in place). Memory is handed back and forth: the KV
cache sleeps outside generation (`free_cache_after_generate`), and with `optimizer_offload` /
`param_offload` the optimizer state / parameter shards stay on the CPU except while they are used.
With world size > 1 each rank runs its own rollout replica on its shard of the prompts.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.engine.train import TrainEngine
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.reference import ReferenceModel, temperature_of
from hybridflow.workers.rollout import build_rollout, completions_to_batch, prompt_token_lists, sampling_params
from hybridflow.workers.update import actor_loss, run_update


def _pad_id(config) -> int:
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


class ActorWorker(EngineWorker):
    """The actor (and, with `with_ref`, its reference) on this rank.

    Args:
        model_cfg, actor_cfg, rollout_cfg: the config sections (read by attribute).
        data_cfg: anything with `max_prompt_length` and `max_response_length`.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        with_ref: also hold a frozen reference model (from `ref_model_path`, default the actor's path).
        with_rollout: build the rollout engine (False for log-prob-only uses such as SFT evaluation).
    """

    def __init__(self, model_cfg: Any, actor_cfg: Any, rollout_cfg: Any, data_cfg: Any, total_steps: int = 1,
                 with_ref: bool = False, ref_model_path: str | None = None, with_rollout: bool = True) -> None:
        self.cfg, self.rollout_cfg = actor_cfg, rollout_cfg
        self.max_response_length = data_cfg.max_response_length
        self.engine = TrainEngine(model_cfg, actor_cfg, head="lm", total_steps=total_steps, device=self.device)
        self.ref = ReferenceModel(model_cfg, actor_cfg, ref_model_path, self.device) if with_ref else None
        self.pad_id = _pad_id(self.engine.config)
        self.rollout = None
        if with_rollout:
            max_len = data_cfg.max_prompt_length + data_cfg.max_response_length
            self.rollout = build_rollout(model_cfg.path, rollout_cfg, self.device, self.engine.precision.param,
                                         max_len)
            self._rollout_awake = True
            if rollout_cfg.free_cache_after_generate:
                self._sleep_rollout()
        self.update_count = 0
        self._offload_idle()

    # ------------------------------------------------------------------ memory hand-over
    def _sleep_rollout(self) -> None:
        if self.rollout is not None and self._rollout_awake:
            self.rollout.sleep()
            self._rollout_awake = False

    def _wake_rollout(self) -> None:
        if self.rollout is None:
            raise RuntimeError("this ActorWorker was built with with_rollout=False; it cannot generate")
        if not self._rollout_awake:
            self.rollout.wake()
            self._rollout_awake = True

    # ------------------------------------------------------------------ RL-step methods
    @register(Dispatch.DATA_PARALLEL)
    def generate(self, batch: Batch) -> Batch:
        """Prompts (`prompts` left-padded + their `attention_mask`; meta `sampling`) -> rows of the RL
        batch, `n` samples per prompt interleaved; meta gets `temperature` and `timing_s/gen`."""
        start = time.perf_counter()
        params = sampling_params(batch.meta, self.rollout_cfg, self.max_response_length, self.rank)
        prompts = prompt_token_lists(batch["prompts"], batch["attention_mask"])
        self._wake_rollout()
        outs = self.rollout.generate(prompts, params)
        if self.rollout_cfg.free_cache_after_generate:
            self._sleep_rollout()
        out = completions_to_batch(batch, outs, params.n, self.max_response_length, self.pad_id)
        out.meta.update(temperature=params.temperature, gen_seconds=time.perf_counter() - start)
        return out

    @register(Dispatch.DATA_PARALLEL)
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Batch{old_log_probs, entropy} (`[B, R]`) of the current actor at the sampling temperature."""
        self._onload()
        out = self.engine.infer(batch.tensors, micro_batch_size=self.cfg.micro_batch_size,
                                max_tokens=self.cfg.max_tokens_per_micro_batch,
                                temperature=temperature_of(batch, self.rollout_cfg.temperature),
                                with_entropy=True, pack=self.cfg.use_packing)
        self._offload_idle()
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DATA_PARALLEL)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """Batch{ref_log_probs} from the colocated reference model."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_probs needs the ActorWorker built with with_ref=True")
        return self.ref.log_probs(batch, temperature_of(batch, self.rollout_cfg.temperature))

    @register(Dispatch.DATA_PARALLEL)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; metrics (identical on all ranks) with the field's names."""
        use_kl = self.cfg.kl_loss_coef > 0
        if use_kl and "ref_log_probs" not in batch:
            raise KeyError("actor.kl_loss_coef > 0 needs `ref_log_probs` in the batch (compute_ref_log_probs)")
        use_entropy = self.cfg.entropy_coef != 0
        self._sleep_rollout()
        self._onload()
        metrics = run_update(self.engine, batch.tensors, self.cfg, actor_loss(self.cfg, use_kl, use_entropy),
                             prefix="actor", rollout_n=int(batch.meta.get("rollout_n", self.rollout_cfg.n)),
                             temperature=temperature_of(batch, self.rollout_cfg.temperature),
                             with_entropy=use_entropy or "entropy" not in batch, seed=self.update_count)
        self._offload_idle()
        if not use_entropy and "entropy" in batch:
            mask = batch["response_mask"]
            metrics["actor/entropy"] = float((batch["entropy"] * mask).sum() / mask.sum().clamp(min=1))
        self.update_count += 1
        return metrics

    @register(Dispatch.BROADCAST)
    def sync_weights(self) -> dict[str, float]:
        """Trained shards -> the rollout engine's weights, in place, one gathered parameter at a time
        cast to the rollout dtype; returns `timing_s/update_weights`."""
        start = time.perf_counter()
        if self.cfg.param_offload:
            self.engine.onload(params=True, optimizer=False)
        self.rollout.load_weights(self.engine.iter_full_params(dtype=self.engine.precision.param))
        if self.cfg.param_offload:
            self.engine.offload(params=True, optimizer=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"timing_s/update_weights": time.perf_counter() - start}
