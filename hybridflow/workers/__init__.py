"""Role classes living in worker processes: the actor (train + rollout + reference), the reference, the critic."""

from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import ReferenceWorker

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker"]
