"""Typed configuration: the schema dataclasses, the YAML + `key=value` loader and the cross-key checks."""

from hybridflow.config.loader import ConfigError, config_diff, load_config, to_yaml, validate
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import (ActorConfig, AlgorithmConfig, CriticConfig, DataConfig, RewardConfig, RLConfig,
                                      RolloutConfig, TrainerConfig)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "ModelConfig",
    "RLConfig", "RewardConfig", "RolloutConfig", "TrainerConfig", "config_diff", "load_config",
    "to_yaml", "validate",
]
