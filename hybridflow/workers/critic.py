"""`CriticWorker`: the value model role — backbone + scalar head under the FSDP2 engine.

The critic may start from a different model directory than the actor (`critic_cfg.model.path`; None
takes the actor's). Values for response token t come from the hidden state at position
prompt_end + t - 1, the alignment of the log-probs. Given its device's `memory` demand it plans the
device as the actor does (`hybridflow.engine.budget`).
"""

from __future__ import annotations

import copy
from typing import Any

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.train import TrainEngine
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.update import critic_loss


class CriticWorker(EngineWorker):
    """Args: critic_cfg (with `.model`), actor_model_cfg (whose `path` fills a missing critic path),
    total_steps (the lr schedule's length), rollout_n (samples per prompt, for mini-batch sizes), memory
    (this device's demand; None = no planning), seed (of the value head's and LoRA adapters' initialisation:
    `trainer.seed`)."""

    keys, model_keys = "critic", "critic.model"

    def __init__(self, critic_cfg: Any, actor_model_cfg: Any | None = None, total_steps: int = 1,
                 rollout_n: int = 1, memory: budget.DeviceDemand | None = None, seed: int = 0) -> None:
        model_cfg = copy.copy(critic_cfg.model)
        if model_cfg.path is None:
            if actor_model_cfg is None:
                raise ValueError("critic.model.path is null and no actor model config was given to inherit from")
            model_cfg.path = actor_model_cfg.path
        model_cfg, critic_cfg = self._plan_device(memory, model_cfg, critic_cfg)
        self.cfg, self.rollout_n = critic_cfg, rollout_n
        self.engine = TrainEngine(model_cfg, critic_cfg, head="value", total_steps=total_steps, device=self.device,
                                  seed=seed)
        self._offload_idle()

    @register(Dispatch.DATA_PARALLEL)
    def compute_values(self, batch: Batch) -> Batch:
        """Batch{values [B, R]} for prompt + response rows."""
        return Batch({"values": self._infer(batch)["values"]})

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss epochs over mini-batches: critic/vf_loss, critic/vf_clipfrac, critic/grad_norm,
        critic/lr, ... (identical on all ranks). Needs `values` (old), `returns`, `response_mask`."""
        for key in ("values", "returns"):
            if key not in batch:
                raise KeyError(f"update_critic needs `{key}` in the batch; it has {batch.keys()}")
        return self._update(batch, critic_loss(self.cfg), passes=self.cfg.ppo_epochs, prefix="critic",
                            rollout_n=self.rollout_n)
