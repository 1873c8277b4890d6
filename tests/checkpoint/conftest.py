"""Fixtures for the checkpoint tests."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import make_training_objects, train_step


@pytest.fixture
def trained(tiny_qwen2):
    """A tiny Qwen2 model, its AdamW optimizer and LR scheduler after one real training step."""
    torch.manual_seed(0)
    objects = make_training_objects(tiny_qwen2)
    train_step(*objects)
    return objects
