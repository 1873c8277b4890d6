"""Engines that worker processes drive: `train` (FSDP2 training) and `rollout` (generation)."""
