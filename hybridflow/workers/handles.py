"""What the controller asks of worker handles, as `typing.Protocol`s: the calls a trainer makes, whichever group
or colocated member answers them.

`RolloutHandle` is what generates (the actor's colocated engine or a separate `RolloutWorker` group: both keep
it); `TrainedRoleHandle` is a trained role the run checkpoints and whose effective values it records (the
actor, the critic, the SFT model). A trainer holds its handles by these types (`Remote[W]` is the worker
class itself to a type checker), and a test may hand it any object that keeps them.
"""

from __future__ import annotations

from typing import Protocol

from hybridflow.batch import Batch
from hybridflow.engine.rollout import SamplingParams
from hybridflow.workers.base import Effective


class RolloutHandle(Protocol):
    def generate(self, batch: Batch, params: SamplingParams, step: int = 0) -> Batch:
        """Prompts -> rows of the RL batch, `params.n` samples per prompt interleaved; a seed in `params` is
        mixed with `step` and each rank."""
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

    def effective_values(self) -> Effective:
        """The values its workers run with where the config left them open, and their device plan."""
        ...
