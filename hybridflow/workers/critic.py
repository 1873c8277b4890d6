"""`CriticWorker`: the value model role — backbone + scalar head under the FSDP2 engine.

The critic may start from a different model directory than the actor (`critic.model.path`; the controller
fills a null one in with the actor's: `hybridflow.trainer.role_configs`). Values for response token t come from the hidden state at position
prompt_end + t - 1, the alignment of the log-probs. Given its device's `memory` demand it plans the
device as the actor does (`hybridflow.engine.budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import CriticConfig
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.train import TrainEngine
from hybridflow.workers.base import EngineWorker
from hybridflow.workers.update import critic_loss


class CriticWorker(EngineWorker):
    """The value model on this rank."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a critic worker is built from, resolved on the controller.

        model: the critic's model section, its `path` filled in (a null `critic.model.path` is the actor's).
        critic: the `critic` section.
        mini_batch_rows: rows per optimizer step over all ranks (`critic.mini_batch_size x rollout.n`);
            None = the whole batch.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        memory: this device's demand; None = no planning.
        seed: of the value head's and LoRA adapters' initialisation (`trainer.seed`).
        """

        model: ModelConfig
        critic: CriticConfig
        mini_batch_rows: int | None = None
        total_steps: int = 1
        memory: budget.DeviceDemand | None = None
        seed: int = 0

    keys, model_keys = "critic", "critic.model"
    cfg: CriticConfig

    def __init__(self, config: CriticWorker.Config) -> None:
        if config.model.path is None:
            raise ValueError("CriticWorker.Config.model.path is null: the controller fills it in with the actor's "
                             "model.path (hybridflow.trainer.role_configs.critic_config)")
        model_cfg, critic_cfg = self._plan_device(config.memory, config.model, config.critic)
        self.cfg, self.mini_batch_rows = critic_cfg, config.mini_batch_rows
        self.engine = TrainEngine(model_cfg, critic_cfg, head="value", total_steps=config.total_steps,
                                  device=self.device, seed=config.seed)
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
        return self._update(batch, critic_loss(self.cfg), passes=self.cfg.ppo_epochs, prefix="critic")
