"""No checkpoint with non-finite weights (issue 56), through the commands on a tiny model (in-process): weights
forced to NaN make the save refuse, naming the step and the parameter, the run stop with exit 2 and the previous
checkpoint survive bitwise; a step whose gradient norm is NaN is skipped and its checkpoint holds finite weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from rl_helpers import base_overrides, read_metrics

from hybridflow import cli
from hybridflow.checkpoint import read_full_model_state
from hybridflow.engine.train.engine import TrainEngine


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _at_update(monkeypatch, number: int, before=None, after=None) -> None:
    """Runs `before(engine)` / `after(engine)` around the engine's `number`-th optimizer update."""
    original, calls = TrainEngine.clip_and_step, []

    def clip_and_step(engine):
        calls.append(1)
        if len(calls) == number and before:
            before(engine)
        result = original(engine)
        if len(calls) == number and after:
            after(engine)
        return result

    monkeypatch.setattr(TrainEngine, "clip_and_step", clip_and_step)


def test_nan_weights_are_never_saved_and_the_previous_checkpoint_survives(tiny_qwen2, chats, tmp_path, monkeypatch,
                                                                         capsys):
    out, seen = tmp_path / "run", {}
    first = out / "checkpoints" / "step_00000001"

    def poison(engine):
        seen["step 1"] = _digests(first)  # committed before step 2 trained
        with torch.no_grad():
            next(engine.model.parameters()).view(-1)[:3] = float("nan")

    _at_update(monkeypatch, 2, after=poison)
    assert cli.main(["sft", f"model.path={tiny_qwen2}", f"data.train_files={chats}", "data.train_batch_size=4",
                     "trainer.total_steps=3", "trainer.save_every=1", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "hybridflow sft: cannot save step 2: the sft weights are not finite: model.embed_tokens.weight (3 of " \
           in err and "values are NaN or inf) on rank 0; no checkpoint is written with them and the run stops; the " \
           f"previous checkpoint {first} is kept intact" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]  # no step 2, no temp dir
    assert _digests(first) == seen["step 1"]


def test_a_step_with_a_nan_gradient_norm_is_skipped_and_saves_finite_weights(tiny_qwen2, data_dir, tmp_path,
                                                                            monkeypatch):
    def nan_gradient(engine):
        next(p for p in engine.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    _at_update(monkeypatch, 2, before=nan_gradient)
    out = tmp_path / "run"
    assert cli.main(["train", "--config", "recipes/grpo.yaml",
                     *base_overrides(tiny_qwen2, data_dir, out, "trainer.val_before_train=false",
                                     "trainer.val_every=0", "trainer.save_every=1")]) == 0
    steps = [r for r in read_metrics(out) if "actor/grad_norm" in r]
    assert [r["actor/skipped_steps"] for r in steps] == [0.0, 1.0]  # step 2's norm was NaN: no optimizer step
    weights = read_full_model_state(out / "checkpoints" / "step_00000002" / "actor")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
