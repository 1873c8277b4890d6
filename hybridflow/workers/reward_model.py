"""`RewardModelWorker`: a model-based reward (a sequence-classification model) as a worker role.

The trainer colocates it with the actor (one process per device) when `reward.reward_model.path` is
set; `score` reads each row's `raw_prompt` and decoded `response_text` and returns `rm_scores [B]`.
"""

from __future__ import annotations


import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RewardModelConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.rewards.model_reward import ModelReward


class RewardModelWorker(Worker):
    """Args: rm_cfg (`RewardModelConfig`: `path`, `micro_batch_size`), dtype ("auto" = bf16 on cuda)."""

    def __init__(self, rm_cfg: RewardModelConfig, dtype: str = "auto") -> None:
        if rm_cfg.path is None:
            raise ValueError("RewardModelWorker needs reward.reward_model.path (null means no reward model)")
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.model = ModelReward(rm_cfg.path, device=str(self.device), dtype=dtype,
                                 batch_size=rm_cfg.micro_batch_size)

    @register(Dispatch.DATA_PARALLEL)
    def score(self, batch: Batch) -> Batch:
        """Batch{rm_scores [B] float32}: the reward model's score of prompt + response for each row."""
        texts = self.model.format_texts(list(batch["raw_prompt"]), list(batch["response_text"]))
        return Batch({"rm_scores": torch.tensor(self.model.score(texts), dtype=torch.float32)})
