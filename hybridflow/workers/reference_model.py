"""The reference policy: a frozen copy of the initial actor that scores responses (`ref_log_probs`).

`ReferenceModel` is held by the actor (`ActorWorker.Config.reference_copy`), on the actor's devices. With
`ref_param_offload` the frozen weights live on the CPU between calls. A LoRA actor holds none: its own base
weights, its adapters disabled for the pass, are the reference (`ActorWorker.compute_ref_log_probs`).
"""

from __future__ import annotations

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig, ModelConfig
from hybridflow.engine.train import TrainEngine


class ReferenceModel:
    """A frozen `TrainEngine` (weights stored in the compute dtype, no optimizer)."""

    def __init__(self, model_cfg: ModelConfig, actor_cfg: ActorConfig, device: torch.device) -> None:
        self.actor_cfg = actor_cfg
        self.offload = actor_cfg.ref_param_offload
        self.engine = TrainEngine(model_cfg, None, head="lm", device=device)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)

    def log_probs(self, batch: Batch, temperature: float) -> Batch:
        """Batch{ref_log_probs [B, R]} for prompt + response rows."""
        if self.offload:
            self.engine.onload(params=True, optimizer=False)
        out = self.engine.infer(batch.tensors, micro_batch_size=self.actor_cfg.micro_batch_size,
                                max_tokens=self.actor_cfg.max_tokens_per_micro_batch, temperature=temperature,
                                pack=self.actor_cfg.use_packing)
        if self.offload:
            self.engine.offload(params=True, optimizer=False)
        return Batch({"ref_log_probs": out["log_probs"]})


def scoring_temperature(sampling_temperature: float) -> float:
    """The temperature log-probs of rows sampled at `sampling_temperature` are computed at: the same one,
    except greedy rows (0), scored at 1."""
    return sampling_temperature if sampling_temperature > 0 else 1.0
