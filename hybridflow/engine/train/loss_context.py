"""The contract between a loss and `TrainEngine.train_step`: the loss function's signature (`LossFn`) and
the mini-batch counts it normalises by (`LossContext`), so the engine micro-batches without knowing the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LossContext:
    """Counts over the whole mini-batch on all data-parallel ranks, for loss aggregation: a micro-batch's
    loss is its share of the mini-batch loss (normalised by these), so shares sum to the whole."""

    global_tokens: float
    global_seqs: float
    dp_size: int

    def share_to_value(self, mask: torch.Tensor) -> torch.Tensor:
        """The factor turning a micro-batch's share of a token-weighted mean back into the micro-batch's
        own value (`mask`: its response mask), so the engine's token-weighted average of reported
        metrics gives the mini-batch's value. A tensor on the mask's device: no micro-batch waits for
        the GPU to count its tokens."""
        return self.global_tokens / mask.sum().clamp(min=1.0)


LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossContext],
                  tuple[torch.Tensor, dict[str, float | torch.Tensor]]]
