"""Role classes living in worker processes: the actor (train + rollout + reference), the rollout on its own
devices, the critic, the reward model."""

from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout_worker import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "RewardModelWorker", "RolloutWorker"]
