"""What the controller asks of worker handles, as `typing.Protocol`s: the calls a trainer makes, whichever group
or colocated member answers them.

`RolloutHandle` is what generates (the actor's colocated engine or a separate `RolloutWorker` group: both keep
it); `TrainedRoleHandle` is a trained role the run checkpoints and whose effective values it records (the
actor, the critic, the SFT model). A trainer holds its handles by these types (`Remote[W]` is the worker
class itself to a type checker), and a test may hand it any object that keeps them.
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridflow.batch import Batch
from hybridflow.engine.rollout import SamplingParams
from hybridflow.workers.base import Effective


class RolloutHandle(Protocol):
    def generate(self, batch: Batch, params: SamplingParams, step: int = 0) -> Batch:
        """Prompts -> rows of the RL batch, `params.n` samples per prompt interleaved; a seed in `params` is
        mixed with `step` and each rank."""
        ...

    # one result per rank (called through `hybridflow.controller.per_rank`): a step's generation with each
    # token's policy version, and partial rollouts' in-flight buffers (`hybridflow.workers.rollout_calls`)
    def generate_versioned(self, prompts: Batch, params: SamplingParams, step: int,
                           version: int) -> tuple[Batch, dict[str, float]]:
        """A rank's rows with `rollout_versions`, and its generation stats."""
        ...

    def generate_groups(self, prompts: Batch, params: SamplingParams, step: int, version: int, count: int,
                        finish_before: int | None = None) -> tuple[Batch, dict[str, float]]:
        """A rank's share of the prompts joins its in-flight buffer; its `count` complete groups' rows (those
        older than `finish_before` finished first), and stats."""
        ...

    def in_flight(self, oldest_version: int) -> dict[str, int]:
        """A rank drops its groups older than `oldest_version`: {"groups" left, samples "dropped"}."""
        ...

    def partial_state(self) -> dict[str, Any]:
        """A rank's in-flight buffer, for a checkpoint."""
        ...

    def load_partial_state(self, states: list[dict[str, Any]]) -> None:
        """Every rank r continues from `states[r]`."""
        ...

    def effective_values(self) -> Effective:
        """The values its workers run with where the config left them open, and their device plan."""
        ...


class TrainedRoleHandle(Protocol):
    def save_checkpoint(self, role_dir: str) -> None:
        """Model and optimizer shards, RNG and the role's small state under `role_dir` (collective)."""
        ...

    def load_checkpoint(self, role_dir: str) -> None:
        """The inverse of `save_checkpoint`, on any number of ranks."""
        ...

    # one result per rank (called through `hybridflow.controller.per_rank`)
    def non_finite_weights(self) -> str | None:
        """A rank's first parameter holding NaN or inf (name and count), or None."""
        ...

    def effective_values(self) -> Effective:
        """The values its workers run with where the config left them open, and their device plan."""
        ...
