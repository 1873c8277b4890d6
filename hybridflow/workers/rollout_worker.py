"""`RolloutWorker`: the rollout engine on its own devices (`rollout.placement=separate`).

Each rank owns one `RolloutReplica` (engine, KV cache, CUDA graphs) on its device and nothing else: no
trainer, no optimizer. It serves the calls that generate (`RolloutCalls`: `generate`, and partial rollouts'
in-flight buffer) with the same data-parallel contract and output as the actor's colocated engine, and takes
new weights from the actor over the weight-sync group (`join_weight_sync` once, then `receive_weights` at each
sync, concurrently with the actor's `send_weights`; see `hybridflow.workers.weight_sync`).
"""

from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass

import torch

from hybridflow.config.model_schema import ModelConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine import budget
from hybridflow.engine.train.model import resolve_precision
from hybridflow.utils.lm_class import text_view
from hybridflow.workers.base import Effective
from hybridflow.workers.rollout_calls import RolloutCalls
from hybridflow.workers.rollout_replica import RolloutReplica, pad_token_id
from hybridflow.workers.weight_sync import WeightChannel


class RolloutWorker(RolloutCalls, Worker):
    """A rollout replica on this rank, in the dtype the actor's rollout would use (`model.dtype`); the calls
    that generate come from `RolloutCalls`."""

    rollout: RolloutReplica  # always built here

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a rollout worker is built from, resolved on the controller.

        model: the `model` section (its directory, dtype and `trust_remote_code`).
        replica: the rollout engine's config (`RolloutReplica.Config`).
        memory: this device's demand (the rollout alone); its plan sizes the KV cache. None = no planning.
        """

        model: ModelConfig
        replica: RolloutReplica.Config
        memory: budget.DeviceDemand | None = None

    def __init__(self, config: RolloutWorker.Config) -> None:
        from transformers import AutoConfig

        self.plan = budget.plan_for_device(config.memory, self.device)
        model = config.model
        if model.path is None:
            raise ValueError("RolloutWorker.Config.model.path is null; set model.path")
        hf_config = text_view(AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code))
        dtype = resolve_precision(model.dtype, self.device).param
        replica = dataclasses.replace(config.replica,
                                      rollout=budget.apply_rollout_plan(self.plan, config.replica.rollout))
        self.rollout = RolloutReplica(replica, self.device, dtype, pad_token_id(hf_config),
                                      kv_cache_bytes=self.plan.kv_cache_bytes if self.plan else None,
                                      hold_allocator=lambda outside: budget.hold_beside(self.plan, self.device,
                                                                                        outside),
                                      max_prefill_tokens=self.plan.max_prefill_tokens if self.plan else None)
        self.channel: WeightChannel | None = None

    @register(Dispatch.BROADCAST)
    def effective_values(self) -> Effective:
        """The rollout keys this group runs with (`RolloutReplica.effective_values`) and its device plan."""
        return Effective(self.rollout.effective_values(), None if self.plan is None else self.plan.describe())

    @register(Dispatch.BROADCAST)
    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Joins the weight-sync group at `host:port` as rank 1 + this rank (the actor's rank 0 is rank 0)."""
        self.channel = WeightChannel(host, port, 1 + self.rank, world_size, self.device)

    @register(Dispatch.BROADCAST)
    def receive_weights(self) -> dict[str, float]:
        """The actor's weights, bucket by bucket, copied into the engine in place (concurrently with the
        actor's `send_weights`); returns `timing_s/update_weights`."""
        if self.channel is None:
            raise RuntimeError("receive_weights needs join_weight_sync first")
        start = time.perf_counter()
        self.rollout.load_weights(self.channel.receive())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"timing_s/update_weights": time.perf_counter() - start}
