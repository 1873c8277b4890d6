"""`RolloutCalls`: the controller-facing methods that generate, shared by the two workers that hold a rollout
replica (`ActorWorker`, colocated, and `RolloutWorker`, on its own devices).

Each takes the sampling settings and the step as arguments (`generate(batch, params, step)`). `generate` is a
call's rows; `generate_versioned` is a trainer step's generation with each token's policy version and the
generation's stats. Each rank's replica owns its in-flight buffer of partial rollouts
(`hybridflow.workers.partial_rollout`), and the other methods expose it: `generate_groups` (a step's new
prompts in, its complete groups out), `in_flight` (drop the groups too stale to train, count what is left), and
`partial_state` / `load_partial_state` (the buffer in a checkpoint). A worker runs the replica's calls inside
`_generating()`, where the actor hands memory over to the engine.

`generate_versioned`, `generate_groups`, `in_flight` and `partial_state` give one result per rank: the
controller calls them through `per_rank` (`hybridflow.controller`), which types them as the list they return.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.engine.rollout import SamplingParams
from hybridflow.workers.rollout_replica import RolloutReplica


class RolloutCalls:
    """Mixed into a `Worker` that sets `self.rollout` (a `RolloutReplica`, or None without an engine)."""

    rollout: RolloutReplica | None
    rank: int

    @contextlib.contextmanager
    def _generating(self) -> Iterator[RolloutReplica]:
        """The replica, for a call that generates (a worker may wrap it: memory hand-over, errors)."""
        if self.rollout is None:
            raise RuntimeError(f"this {type(self).__name__} has no rollout engine (with rollout.placement=separate "
                               f"the RolloutWorker group generates)")
        yield self.rollout

    @register(Dispatch.DATA_PARALLEL)
    def generate(self, batch: Batch, params: SamplingParams, step: int = 0) -> Batch:
        """Prompts -> rows of the RL batch, `params.n` samples per prompt interleaved; a seed in `params` is
        mixed with `step` and the rank (see `RolloutReplica.generate`)."""
        with self._generating() as rollout:
            return rollout.generate(batch, params, step, self.rank)

    @register(Dispatch.DATA_PARALLEL)
    def generate_versioned(self, prompts: Batch, params: SamplingParams, step: int,
                           version: int) -> tuple[Batch, dict[str, float]]:
        """A trainer step's generation: `generate`'s rows, each token's policy version recorded
        (`rollout_versions`, the engine's weights being at `version`), and the generation stats."""
        with self._generating() as rollout:
            return rollout.generate(prompts, params, step, self.rank, version), rollout.generation_stats()

    @register(Dispatch.DATA_PARALLEL)
    def generate_groups(self, prompts: Batch, params: SamplingParams, step: int, version: int, count: int,
                        finish_before: int | None = None) -> tuple[Batch, dict[str, float]]:
        """`rollout.partial`: this rank's share of a step's new prompts joins its in-flight buffer, then its engine
        (weights at policy `version`) generates until `count` groups are complete, and those from earlier steps
        older than `finish_before` too; returns their rows and the step's generation stats
        (`RolloutReplica.generate_groups`)."""
        with self._generating() as rollout:
            return rollout.generate_groups(prompts, params, step, self.rank, version, count, finish_before)

    @register(Dispatch.BROADCAST, collect="all")
    def in_flight(self, oldest_version: int) -> dict[str, int]:
        """Each rank drops its groups whose oldest token predates `oldest_version`: {"groups", "dropped"}."""
        with self._generating() as rollout:
            return rollout.in_flight(oldest_version)

    @register(Dispatch.BROADCAST, collect="all")
    def partial_state(self) -> dict[str, Any]:
        """Each rank's in-flight buffer, for a checkpoint (its samples suspended to the host)."""
        with self._generating() as rollout:
            return rollout.partial_state()

    @register(Dispatch.BROADCAST)
    def load_partial_state(self, states: list[dict[str, Any]]) -> None:
        """Rank r continues from `states[r]` (a buffer per rank, `partial_state`'s list or one dealt out anew)."""
        with self._generating() as rollout:
            rollout.load_partial_state(states[self.rank])
