"""Frozen models that score the policy's responses: the reference policy (`ref_log_probs`) and the teacher of
on-policy distillation (`teacher_log_probs`).

`ReferenceModel` is a frozen `TrainEngine` (weights stored in the compute dtype, no optimizer) with the
micro-batching and packing of the actor it sits beside; with `offload` its weights live on the CPU between
calls. The actor holds its reference (`ActorWorker.Config.reference_copy`), on the actor's devices; a LoRA actor
holds none: its own base weights, its adapters disabled for the pass, are the reference
(`ActorWorker.compute_ref_log_probs`). The distillation teacher is a `TeacherWorker` (`hybridflow.workers.teacher`)
colocated with the actor.
"""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.config.model_schema import EngineOptimConfig, FrozenModelConfig
from hybridflow.engine.train import TrainEngine


class ReferenceModel:
    """A frozen causal LM on `device`: `model_cfg` its model section, `batching_cfg` the (actor's) section whose
    `micro_batch_size`, `max_tokens_per_micro_batch` and `use_packing` its forwards use; `images`: the actor's
    prompts carry images (`TrainEngine`'s)."""

    def __init__(self, model_cfg: FrozenModelConfig, batching_cfg: EngineOptimConfig, device: torch.device,
                 offload: bool = False, images: bool = False) -> None:
        self.batching_cfg, self.offload = batching_cfg, offload
        self.engine = TrainEngine(model_cfg, None, head="lm", device=device, images=images)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)

    def log_probs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """`[B, R]` log-probs of the response tokens of prompt + response rows."""
        return self.scores(batch, temperature)["log_probs"]

    def scores(self, batch: Batch, temperature: float, topk: int = 0) -> dict[str, torch.Tensor]:
        """`TrainEngine.infer`'s outputs for prompt + response rows: `log_probs` `[B, R]` and, with `topk`,
        `topk_ids` / `topk_log_probs` `[B, R, k]`."""
        if self.offload:
            self.engine.onload(params=True, optimizer=False)
        cfg = self.batching_cfg
        out = self.engine.infer(batch.tensors, micro_batch_size=cfg.micro_batch_size,
                                max_tokens=cfg.max_tokens_per_micro_batch, temperature=temperature,
                                pack=cfg.use_packing, topk=topk)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)
        return out


def scoring_temperature(sampling_temperature: float) -> float:
    """The temperature log-probs of rows sampled at `sampling_temperature` are computed at: the same one,
    except greedy rows (0), scored at 1."""
    return sampling_temperature if sampling_temperature > 0 else 1.0
