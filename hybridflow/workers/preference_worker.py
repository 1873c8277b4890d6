"""`PreferenceWorker`: a model trained on preference pairs on one rank — a policy (`hybridflow dpo`) or a reward
model (`hybridflow rm`) — and the losses it trains on.

Each pair of a batch (one row, `hybridflow.data.preference_data`) becomes two rows of the training engine,
chosen at 2i and rejected at 2i + 1, which always share a micro-batch (`row_group=2`). A sequence's value is
its summed log-prob over the completion's loss mask (a policy, `head="lm"`) or the score at its last token (a
reward model, `head="score"`). The losses (`dpo_loss`, `reward_model_loss`) call the pure functions of
`hybridflow.algorithms.preference_losses` on those per-pair values and average over the mini-batch's pairs on every
rank, so micro-batching and data parallelism leave them unchanged; their metrics are the mini-batch's means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algorithms import bradley_terry_loss, compute_preference_loss
from hybridflow.batch import Batch
from hybridflow.config.preference_schema import DPOLossConfig, PreferenceOptimConfig, RewardModelLossConfig
from hybridflow.config.model_schema import ModelConfig
from hybridflow.controller import Dispatch, register
from hybridflow.data.preference_data import policy_rows, scored_rows
from hybridflow.engine import budget
from hybridflow.engine.contracts import LossFunction
from hybridflow.engine.train import LossContext, TrainEngine
from hybridflow.workers.base import EngineWorker

PAIR = 2  # engine rows per pair


def pair_values(out: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """`[pairs, 2]`: each row's summed log-prob over `mask` (a policy) or its score (a reward model, whose one
    response position is its last token)."""
    values = out["log_probs"] if "log_probs" in out else out["values"]
    return (values * mask).sum(-1).view(-1, PAIR)


def _pair_metrics(kind: str, values: dict[str, torch.Tensor], real: torch.Tensor, ctx: LossContext,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`<kind>/<name>`: the mini-batch's mean over real pairs of each per-pair value, as the micro-batch's
    share scaled for the engine's token-weighted average (`LossContext.share_to_value`)."""
    scale = ctx.share_to_value(mask) / (ctx.global_seqs / PAIR)
    return {f"{kind}/{name}": (v.detach() * real).sum() * scale for name, v in values.items()}


def dpo_loss(cfg: DPOLossConfig) -> LossFunction:
    """`loss_fn` for `TrainEngine.train_step` on `policy_rows`: the mean over pairs of preference loss
    `cfg.loss_type` (a `DPOLossConfig`), with the reference's log-probs (`ref_logps`) when the loss takes them.
    Reports `train/loss`, `dpo/margin` (chosen minus rejected implicit reward), `dpo/accuracy` (share of pairs
    whose chosen reward is higher), `dpo/rewards/{chosen,rejected}`, `dpo/logps/{chosen,rejected}`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        tokens = mask.sum(-1).view(-1, PAIR)
        real = (tokens > 0).all(-1)  # padding pairs of an empty micro-batch have no tokens
        safe = torch.where(real[:, None], pair_values(out, mask), -1.0)  # keeps their loss finite (then dropped)
        tokens = torch.where(real[:, None], tokens, 1.0)
        options: dict[str, float | torch.Tensor] = {"beta": cfg.beta, "simpo_gamma": cfg.simpo_gamma}
        if "ref_logps" in mb:
            ref = mb["ref_logps"].view(-1, PAIR)
            options.update(ref_chosen_logps=ref[:, 0], ref_rejected_logps=ref[:, 1])
        result = compute_preference_loss(cfg.loss_type, safe[:, 0], safe[:, 1], tokens[:, 0], tokens[:, 1],
                                         **options)
        real = real.to(result.losses.dtype)
        loss = (result.losses * real).sum() / (ctx.global_seqs / PAIR)
        margin = result.chosen_rewards - result.rejected_rewards
        metrics = _pair_metrics("dpo", {"margin": margin, "accuracy": (margin > 0).to(margin.dtype),
                                        "rewards/chosen": result.chosen_rewards,
                                        "rewards/rejected": result.rejected_rewards,
                                        "logps/chosen": safe[:, 0], "logps/rejected": safe[:, 1]}, real, ctx, mask)
        return loss, {"train/loss": loss.detach() * ctx.share_to_value(mask), **metrics}

    return loss_fn


def reward_model_loss(cfg: RewardModelLossConfig) -> LossFunction:
    """`loss_fn` on `scored_rows`: the mean over pairs of the Bradley–Terry loss (`RewardModelLossConfig`).
    Reports `train/loss`, `rm/margin` (chosen minus rejected score), `rm/accuracy`, `rm/score/{chosen,rejected}`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        real = (mask.sum(-1).view(-1, PAIR) > 0).all(-1).to(out["values"].dtype)
        scores = pair_values(out, mask)
        losses = bradley_terry_loss(scores[:, 0], scores[:, 1], center_coef=cfg.center_coef)
        loss = (losses * real).sum() / (ctx.global_seqs / PAIR)
        margin = scores[:, 0] - scores[:, 1]
        metrics = _pair_metrics("rm", {"margin": margin, "accuracy": (margin > 0).to(margin.dtype),
                                       "score/chosen": scores[:, 0], "score/rejected": scores[:, 1]}, real, ctx, mask)
        return loss, {"train/loss": loss.detach() * ctx.share_to_value(mask), **metrics}

    return loss_fn


class PreferenceWorker(EngineWorker):
    """The model trained on pairs on this rank: a `TrainEngine` with head `lm` (a policy) or `score` (a reward
    model), and the loss of its `config.loss` section."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a preference worker is built from, resolved on the controller
        (`hybridflow.trainer.role_configs.preference_config`).

        model / optim: the `model` and `optim` sections.
        loss: the `dpo` section (a policy, head `lm`) or the `rm` section (a reward model, head `score`).
        head: `lm` or `score` (`hybridflow.engine.train.model`).
        pad_id: the token that pads the engine rows (the tokenizer's).
        mini_batch_rows: engine rows per optimizer step over all ranks (`optim.mini_batch_size` x 2, a pair being
            two rows); None = the whole batch.
        total_steps: optimizer steps of the whole run (the lr schedule's length).
        memory: its device's demand (`hybridflow.trainer.memory.sft_demand`); None = no planning.
        seed: of the score head's and LoRA adapters' initialisation (`trainer.seed`).
        """

        model: ModelConfig
        optim: PreferenceOptimConfig
        loss: DPOLossConfig | RewardModelLossConfig
        head: str
        pad_id: int
        mini_batch_rows: int | None = None
        total_steps: int = 1
        memory: budget.DeviceDemand | None = None
        seed: int = 0

    keys, model_keys = "optim", "model"
    cfg: PreferenceOptimConfig

    def __init__(self, config: PreferenceWorker.Config) -> None:
        loss = config.loss
        if (config.head == "lm") != isinstance(loss, DPOLossConfig):
            raise ValueError(f"PreferenceWorker.Config: head {config.head!r} trains with "
                             f"{'a DPOLossConfig' if config.head == 'lm' else 'a RewardModelLossConfig'}, "
                             f"got {type(loss).__name__}")
        model_cfg, optim_cfg = self._plan_device(config.memory, config.model, config.optim)
        self.cfg, self.mini_batch_rows, self.pad_id = optim_cfg, config.mini_batch_rows, config.pad_id
        self.loss_fn = dpo_loss(loss) if isinstance(loss, DPOLossConfig) else reward_model_loss(loss)
        self.engine = TrainEngine(model_cfg, optim_cfg, head=config.head, total_steps=config.total_steps,
                                  device=self.device, seed=config.seed)
        self._offload_idle()

    def _rows(self, batch: Batch) -> Batch:
        rows = policy_rows if self.engine.head == "lm" else scored_rows
        return Batch(rows(batch.tensors, self.pad_id))

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def train_batch(self, batch: Batch) -> dict[str, float]:
        """Optimizer step(s) on this rank's pairs; `train/{loss,grad_norm,lr}` and the loss's pair metrics,
        identical on all ranks."""
        return self._update(self._rows(batch), self.loss_fn, passes=self.cfg.passes_per_batch, prefix="train",
                            row_group=PAIR)

    @register(Dispatch.DATA_PARALLEL, pad=True)
    def score_pairs(self, batch: Batch) -> Batch:
        """Batch{chosen, rejected} `[P]`: each side's summed log-prob over its loss mask (a policy) or its score
        (a reward model), with no update, uncompiled: the reference's one pass and validation's few do not
        repay compiling a no-grad graph."""
        rows = self._rows(batch)
        values = pair_values(self._infer(rows, row_group=PAIR, eager=True), rows["response_mask"])
        return Batch({"chosen": values[:, 0].contiguous(), "rejected": values[:, 1].contiguous()})
