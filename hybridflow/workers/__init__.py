"""Role classes living in worker processes: the actor (train + rollout + reference), the rollout on its own
devices, the critic, the reward model, the distillation teacher; SFT's and preference training's models."""

from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout_worker import RolloutWorker
from hybridflow.workers.teacher import TeacherWorker

__all__ = ["ActorWorker", "CriticWorker", "RewardModelWorker", "RolloutWorker", "TeacherWorker"]
