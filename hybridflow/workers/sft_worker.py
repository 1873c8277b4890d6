"""`SFTWorker`: the model being fine-tuned on one rank, and the SFT loss it trains on.

The loss is the negative log-likelihood of the assistant tokens (`response_mask` of the rows
`hybridflow.data.sft_data.collate_sft_rows` makes), aggregated over the whole mini-batch like the RL losses;
`train_batch` runs the shared update loop (`hybridflow.workers.update.run_update`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algorithms import aggregate
from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig, OptimConfig
from hybridflow.config.sft_schema import SFTOptimConfig
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.contracts import LossFunction
from hybridflow.engine.train import LossContext, TrainEngine
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.workers.base import EngineWorker


def sft_loss(cfg: OptimConfig) -> LossFunction:
    """`loss_fn` for `TrainEngine.train_step`: negative log-likelihood of the masked tokens, aggregated
    with `cfg.loss_agg` over the whole mini-batch; reports `train/loss`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        loss = aggregate(-out["log_probs"], mask, cfg.loss_agg, ctx.global_tokens, ctx.global_seqs, mask.shape[1])
        return loss, {"train/loss": loss.detach() * ctx.share_to_value(mask)}

    return loss_fn


class SFTWorker(EngineWorker):
    """The model being fine-tuned on this rank: a `TrainEngine` and the SFT loss."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What an SFT worker is built from, resolved on the controller.

        model / optim: the `model` and `optim` sections.
        mini_batch_rows: conversations per optimizer step over all ranks (`optim.mini_batch_size`); None =
            the whole batch.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        memory: its device's demand, planned as the RL workers' are (`hybridflow.engine.budget`); None = no
            planning.
        seed: of the LoRA adapters' initialisation (`trainer.seed`).
        """

        model: ModelConfig
        optim: SFTOptimConfig
        mini_batch_rows: int | None = None
        total_steps: int = 1
        memory: budget.DeviceDemand | None = None
        seed: int = 0

    keys, model_keys = "optim", "model"
    cfg: SFTOptimConfig

    def __init__(self, config: SFTWorker.Config) -> None:
        model_cfg, optim_cfg = self._plan_device(config.memory, config.model, config.optim)
        self.cfg, self.mini_batch_rows = optim_cfg, config.mini_batch_rows
        self.engine = TrainEngine(model_cfg, optim_cfg, head="lm", total_steps=config.total_steps,
                                  device=self.device, seed=config.seed)
        self._offload_idle()

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def train_batch(self, batch: Batch) -> dict[str, float]:
        """Optimizer step(s) on this rank's rows; `train/{loss,grad_norm,lr}`, identical on all ranks."""
        return self._update(batch, sft_loss(self.cfg), passes=self.cfg.passes_per_batch, prefix="train")

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def eval_nll(self, batch: Batch) -> dict[str, float]:
        """`{"nll": summed NLL of the masked tokens, "tokens": their count}` over every rank's rows."""
        log_probs, mask = self._infer(batch)["log_probs"], batch["response_mask"]
        local = torch.stack([-(log_probs * mask).sum(), mask.sum()]).double()
        nll, tokens = all_reduce(local, self.device).tolist()
        return {"nll": nll, "tokens": tokens}
