"""`RolloutMismatch`: the actor's training–inference mismatch during one update, measured and corrected.

Inside the update's loss, each micro-batch compares the rollout engine's `rollout_log_probs` with the
trainer's log-probs of the same tokens — `old_log_probs` when they were computed, else the update's own
log-probs, detached (`actor.skip_old_log_probs`: one optimizer step per batch, so the forward runs on
the weights that generated). `correct` records the mismatch statistics and returns the advantages
weighted by `actor.rollout_correction` (a positive per-token weight on the advantage scales every
built-in policy loss's token term by that weight: each is positively homogeneous in the advantage);
`metrics` reduces the statistics over all ranks (a collective). The maths is in
`hybridflow.algorithms.mismatch` and `hybridflow.algorithms.rollout_correction`.

In exact mode (`rollout.exact`) the old log-probs are the rollout's, so comparing them would prove nothing:
the update's own forwards are compared instead, as long as the weights are still those that generated
(`fresh`: until the first optimizer step, so the first mini-batch), and `check` fails the run when they
differ from the rollout's by anything at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridflow.algorithms import merge_mismatch_stats, mismatch_metrics, mismatch_stats, rollout_correction
from hybridflow.algorithms.mismatch import STAT_MAXES
from hybridflow.config.schema import RolloutCorrectionConfig
from hybridflow.engine.train.collectives import all_reduce


class RolloutMismatch:
    """One update's mismatch statistics and its rollout correction (`cfg`: `actor.rollout_correction`).
    `fresh`: exact mode's test of whether the trainer still has the weights that generated (None: not exact)."""

    def __init__(self, cfg: RolloutCorrectionConfig, device: torch.device, fresh: Callable[[], bool] | None = None
                 ) -> None:
        self.cfg, self.device, self.fresh = cfg, device, fresh
        self.stats: torch.Tensor | None = None

    @property
    def exact(self) -> bool:
        return self.fresh is not None

    def correct(self, train_logp: torch.Tensor, mb: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(advantages to train on, `rollout_corr/...` metrics) for micro-batch `mb`, recording its
        statistics (in exact mode, `train_logp` is the update's forward, recorded while `fresh`). Without
        `rollout_log_probs` (a batch from elsewhere than the rollout engine) only `mode=none` works."""
        if "rollout_log_probs" not in mb:
            if self.cfg.mode != "none":
                raise KeyError(f"actor.rollout_correction.mode={self.cfg.mode} needs `rollout_log_probs` in the "
                               f"batch (the log-probs the rollout engine sampled with)")
            return mb["advantages"], {}
        rollout, mask = mb["rollout_log_probs"], mb["response_mask"]
        if self.fresh is None or self.fresh():
            stats = mismatch_stats(train_logp, rollout, mask)
            self.stats = stats if self.stats is None else merge_mismatch_stats(self.stats, stats)
        weights, metrics = rollout_correction(self.cfg.mode, train_logp, rollout, mask, threshold=self.cfg.threshold,
                                              threshold_lower=self.cfg.threshold_lower)
        return mb["advantages"] * weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}

    def metrics(self) -> dict[str, float]:
        """The mismatch metrics over every rank's recorded tokens (every rank must call it)."""
        stats = self.stats if self.stats is not None else mismatch_stats(*(torch.zeros(1, 1),) * 3)
        sums = all_reduce(stats[:-STAT_MAXES], self.device)
        largest = all_reduce(stats[-STAT_MAXES:], self.device, op=dist.ReduceOp.MAX)
        return mismatch_metrics(torch.cat([sums, largest]))

    def check(self, metrics: dict[str, float]) -> None:
        """Exact mode: raise unless `metrics` (this update's, identical on every rank) show the rollout's
        log-probs equal to the trainer's on every compared token. Nothing to check otherwise."""
        if not self.exact:
            return
        gap, k3 = metrics.get("rollout_corr/max_abs_logp_diff"), metrics.get("rollout_corr/k3_kl")
        if gap is None:
            raise RuntimeError("rollout.exact: the update compared no token with the rollout's log-probs (its first "
                               "mini-batch had no response tokens with `rollout_log_probs`)")
        if gap != 0 or k3 != 0:
            raise RuntimeError(f"rollout.exact: the rollout engine's log-probs differ from the trainer's first forward "
                               f"of the update: max |log p_train - log p_rollout| = {gap:.3g}, k3 = {k3:.3g} over "
                               f"the first mini-batch. The kernels of the two engines did not compute the same "
                               f"thing on this run (docs/exact.md says what exact mode covers)")
