"""Helpers for the checkpoint tests: a tiny Qwen2 with AdamW and an LR scheduler, and one real step."""

from __future__ import annotations

import torch


def make_training_objects(model_path, lr: float = 1e-2):
    """(model, AdamW, LambdaLR) over the tiny model at `model_path`, fresh from disk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, vocab: int = 260) -> float:
    """One real step on random tokens drawn from the global torch RNG; returns the loss."""
    ids = torch.randint(4, vocab, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
