"""`SFTWorker`: the model being fine-tuned on one rank, and the SFT loss it trains on.

The loss is the negative log-likelihood of the assistant tokens (`response_mask` of the rows
`hybridflow.data.sft.collate_sft_rows` makes), aggregated over the whole mini-batch like the RL losses;
`train_batch` runs the shared update loop (`hybridflow.workers.update.run_update`).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algorithms import aggregate
from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.engine import budget
from hybridflow.engine.train import LossContext, TrainEngine
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.workers.base import EngineWorker


def sft_loss(cfg: Any):
    """`loss_fn` for `TrainEngine.train_step`: negative log-likelihood of the masked tokens, aggregated
    with `cfg.loss_agg` over the whole mini-batch; reports `train/loss`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        loss = aggregate(-out["log_probs"], mask, cfg.loss_agg, ctx.global_tokens, ctx.global_seqs, mask.shape[1])
        return loss, {"train/loss": loss.detach() * ctx.share_to_value(mask)}

    return loss_fn


class SFTWorker(EngineWorker):
    """The model being fine-tuned on this rank: a `TrainEngine` and the SFT loss; `memory`: its device's
    demand, planned as the RL workers' are (`hybridflow.engine.budget`; None = no planning); `seed`: of the
    LoRA adapters' initialisation (`trainer.seed`)."""

    keys, model_keys = "optim", "model"

    def __init__(self, model_cfg: Any, optim_cfg: Any, total_steps: int = 1,
                 memory: budget.DeviceDemand | None = None, seed: int = 0) -> None:
        model_cfg, optim_cfg = self._plan_device(memory, model_cfg, optim_cfg)
        self.cfg = optim_cfg
        self.engine = TrainEngine(model_cfg, optim_cfg, head="lm", total_steps=total_steps, device=self.device,
                                  seed=seed)
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
