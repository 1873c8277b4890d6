"""Role classes living in worker processes: the actor (train + rollout + reference), the reference, the critic, the reward model."""

from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward_model import RewardModelWorker

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardModelWorker"]
