"""Save → load round trips of model, AdamW, scheduler, small state and RNG; exact resume of a loop."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from checkpoint_helpers import make_training_objects, train_step

from hybridflow.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    load_controller_state,
    load_worker_state,
    read_config,
    restore_rng_state,
    save_controller_state,
    save_worker_state,
)


def _draws():
    return random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3)


def test_rng_round_trip():
    state = capture_rng_state()
    expected = _draws()
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    restore_rng_state(state)
    got = _draws()
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    with pytest.raises(ValueError, match="lacks"):
        restore_rng_state({"python": state["python"]})


def test_worker_state_round_trip(tmp_path, tiny_qwen2, trained):
    model, optimizer, scheduler = trained
    save_worker_state(tmp_path / "actor", model, optimizer, {"lr": scheduler, "note": {"tokens": 24}})
    expected_draw = torch.rand(4)

    torch.manual_seed(99)
    model2, optimizer2, scheduler2 = make_training_objects(tiny_qwen2, lr=0.5)
    assert not torch.equal(model2.model.embed_tokens.weight, model.model.embed_tokens.weight)
    rest = load_worker_state(tmp_path / "actor", model2, optimizer2, {"lr": scheduler2})

    assert rest == {"note": {"tokens": 24}}
    assert torch.equal(torch.rand(4), expected_draw)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    state, state2 = optimizer.state_dict(), optimizer2.state_dict()
    assert state["param_groups"] == state2["param_groups"]
    assert len(state["state"]) == len(state2["state"]) > 0
    for key, slots in state["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, state2["state"][key][slot]), (key, slot)
    assert scheduler2.state_dict() == scheduler.state_dict() and scheduler2.last_epoch == 1


def test_load_into_other_model_names_the_keys(tmp_path, tiny_model_factory, trained):
    model, optimizer, _ = trained
    save_worker_state(tmp_path / "actor", model, optimizer)
    from transformers import AutoModelForCausalLM

    narrower = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen2", hidden=32, heads=2, kv_heads=1))
    with pytest.raises(CheckpointError,
                       match=r"model.embed_tokens.weight: checkpoint \[260, 64\] vs now \[260, 32\]"):
        load_worker_state(tmp_path / "actor", narrower)
    shallower = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen2", layers=1))
    with pytest.raises(CheckpointError, match=r"model.layers.1.\S+: in the checkpoint, not in the model"):
        load_worker_state(tmp_path / "actor", shallower)


class Opaque:
    """Picklable, but not something `torch.load(weights_only=True)` accepts."""


class KLController:
    def __init__(self, value: float):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_small_state_that_would_not_load_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match="'data' \\(Opaque\\) would not load back"):
        save_controller_state(tmp_path, 1, {"a": 1}, {"data": Opaque()})
    with pytest.raises(CheckpointError, match="'fn'"):
        save_controller_state(tmp_path, 1, {"a": 1}, {"fn": lambda: 0})


def test_controller_state_round_trip(tmp_path):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"trainer": {"lr": 0.1, "total": 8, "copy": "${trainer.total}"}})
    kl = KLController(0.05)
    save_controller_state(tmp_path, 5, config, {"kl": kl, "data": {"epoch": 1, "index": 17}},
                          meta={"world_sizes": {"actor": 2}})
    expected = torch.rand(2)
    kl2 = KLController(1.0)
    state = load_controller_state(tmp_path, {"kl": kl2})
    assert kl2.value == 0.05 and state.step == 5 and state.values == {"data": {"epoch": 1, "index": 17}}
    assert state.config == {"trainer": {"lr": 0.1, "total": 8, "copy": 8}} == read_config(tmp_path)
    assert state.meta["world_sizes"] == {"actor": 2}
    assert torch.equal(torch.rand(2), expected)
    with pytest.raises(CheckpointError, match=r"no state for \['critic_lr'\]"):
        load_controller_state(tmp_path, {"critic_lr": kl2})


def _run(model, optimizer, scheduler, steps: range, position: dict) -> dict[int, float]:
    """A toy loop using all three RNGs: python picks a skip, numpy a scale, torch the tokens."""
    losses = {}
    for step in steps:
        position["index"] += random.randint(1, 3)
        scale = float(np.random.uniform(0.5, 1.5))
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.1 * scale
        losses[step] = train_step(model, optimizer, scheduler)
    return losses


def test_exact_resume(tmp_path, tiny_qwen2):
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    straight = _run(*make_training_objects(tiny_qwen2), range(1, 5), {"index": 0})

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    model, optimizer, scheduler = make_training_objects(tiny_qwen2)
    position = {"index": 0}
    first = _run(model, optimizer, scheduler, range(1, 3), position)
    manager = CheckpointManager(tmp_path, keep=2)
    tmp = manager.begin(2)
    save_worker_state(tmp / "actor", model, optimizer, {"lr": scheduler})
    save_controller_state(tmp, 2, {"trainer": {"total_steps": 4}}, {"data": position})
    manager.commit(2, tmp)
    del model, optimizer, scheduler

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    model, optimizer, scheduler = make_training_objects(tiny_qwen2)
    checkpoint = manager.resolve("auto")
    load_worker_state(checkpoint / "actor", model, optimizer, {"lr": scheduler})
    state = load_controller_state(checkpoint)
    resumed = _run(model, optimizer, scheduler, range(state.step + 1, 5), state.values["data"])

    assert first == {1: straight[1], 2: straight[2]}
    assert resumed == {3: straight[3], 4: straight[4]}


def test_estimate_checkpoint_bytes_counts_tied_weights_once():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.checkpoint import estimate_checkpoint_bytes

    linear = torch.nn.Linear(4, 4)
    assert estimate_checkpoint_bytes(linear) == 20 * 4 * 3
    assert estimate_checkpoint_bytes(linear, optimizer_slots=0) == 20 * 4
    linear.bias.requires_grad_(False)
    assert estimate_checkpoint_bytes(linear) == 16 * 4 * 3 + 4 * 4
    with torch.device("meta"):
        embed = torch.nn.Embedding(10, 8)
        head = torch.nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    assert estimate_checkpoint_bytes(embed, head) == 80 * 4 * 3


def test_tied_embedding_is_written_once(tmp_path, trained):
    from torch.distributed.checkpoint import FileSystemReader

    from hybridflow.checkpoint import read_full_model_state

    model, optimizer, _ = trained
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_worker_state(tmp_path / "actor", model, optimizer)
    saved = FileSystemReader(str(tmp_path / "actor" / "model")).read_metadata().state_dict_metadata
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved
    full = read_full_model_state(tmp_path / "actor")
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert torch.equal(full["lm_head.weight"], model.lm_head.weight.detach())
