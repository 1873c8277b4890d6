"""`RolloutWorker`: the rollout engine on its own devices (`rollout.placement=separate`).

Each rank owns one `RolloutReplica` (engine, KV cache, CUDA graphs) on its device and nothing else: no
trainer, no optimizer. It serves `generate` with the same data-parallel contract and output as
`ActorWorker.generate`, and takes new weights from the actor over the weight-sync group
(`join_weight_sync` once, then `receive_weights` at each sync, concurrently with the actor's
`send_weights`; see `hybridflow.workers.weight_sync`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine import budget
from hybridflow.engine.train.model import resolve_precision
from hybridflow.workers.rollout_replica import RolloutReplica, pad_token_id
from hybridflow.workers.weight_sync import WeightChannel


class RolloutWorker(Worker):
    """A rollout replica on this rank, in the dtype the actor's rollout would use (`model.dtype`).

    Args:
        model_cfg, rollout_cfg: the config sections (read by attribute).
        data_cfg: anything with `max_prompt_length` and `max_response_length`.
        memory: this device's demand (the rollout alone); its plan sizes the KV cache. None = no planning.
        agent_cfg: the `agent` config section (multi-turn episodes when it sets an environment or tools).
    """

    def __init__(self, model_cfg: Any, rollout_cfg: Any, data_cfg: Any,
                 memory: budget.DeviceDemand | None = None, agent_cfg: Any = None) -> None:
        from transformers import AutoConfig

        plan = budget.plan_for_device(memory, self.device)
        config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
        dtype = resolve_precision(model_cfg.dtype, self.device).param
        self.rollout = RolloutReplica(model_cfg.path, rollout_cfg, data_cfg, self.device, dtype,
                                      pad_token_id(config), kv_cache_bytes=plan.kv_cache_bytes if plan else None,
                                      agent_cfg=agent_cfg, tokenizer_path=model_cfg.tokenizer_path)
        self.channel: WeightChannel | None = None

    @register(Dispatch.DATA_PARALLEL)
    def generate(self, batch: Batch) -> Batch:
        """Prompts -> rows of the RL batch, `n` samples per prompt interleaved (see `RolloutReplica.generate`)."""
        return self.rollout.generate(batch, self.rank)

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
