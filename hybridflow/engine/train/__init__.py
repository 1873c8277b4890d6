"""FSDP2 training engine over Hugging Face models: `TrainEngine` and the pieces it is built from."""

from hybridflow.engine.train.engine import TrainEngine, timed
from hybridflow.engine.train.logprobs import token_log_probs
from hybridflow.engine.train.loss_context import LossContext

__all__ = ["LossContext", "TrainEngine", "timed", "token_log_probs"]
