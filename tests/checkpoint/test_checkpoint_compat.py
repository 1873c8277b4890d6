"""Resume compatibility: another model refused with the key named; world sizes and run length may differ."""

from __future__ import annotations

import pytest

import copy

import yaml

from hybridflow.checkpoint import (
    IncompatibleCheckpoint,
    check_compatible,
    check_model_config,
    save_controller_state,
)

SAVED = {
    "model": {"path": "/models/qwen2-0.5b", "tokenizer_path": None, "gradient_checkpointing": False},
    "actor": {"lr": 1e-6, "micro_batch_size": 4, "param_offload": False},
    "critic": {"model": {"path": None}},
    "data": {"train_files": ["a.parquet"], "train_batch_size": 32, "max_prompt_length": 512},
    "trainer": {"total_steps": 100, "output_dir": "/runs/a", "loggers": ["console"], "save_every": 10,
                "n_workers": 2},
}


def _with(**changes):
    """SAVED with dotted keys changed."""
    new = copy.deepcopy(SAVED)
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = new
        for part in parents:
            node = node[part]
        node[leaf] = value
    return new


def test_same_config_is_compatible():
    assert check_compatible(SAVED, _with()) == []


def test_world_size_run_length_and_logging_may_differ():
    new = _with(**{"trainer.n_workers": 1, "trainer.total_steps": 400, "trainer.loggers": ["console", "jsonl"],
                   "trainer.output_dir": "/runs/b", "trainer.save_every": 50, "actor.micro_batch_size": 1,
                   "actor.param_offload": True, "model.gradient_checkpointing": True})
    assert check_compatible(SAVED, new) == []


def test_other_changes_are_reported_not_refused():
    changed = check_compatible(SAVED, _with(**{"actor.lr": 2e-6}))
    assert changed == ["actor.lr: 1e-06 (checkpoint) vs 2e-06 (now)"]


def test_another_model_is_refused_with_key_and_values():
    with pytest.raises(IncompatibleCheckpoint) as info:
        check_compatible(SAVED, _with(**{"model.path": "/models/llama-1b", "actor.lr": 2e-6,
                                         "critic.model.path": "/models/rm"}))
    assert info.value.differences == [
        "critic.model.path: None (checkpoint) vs '/models/rm' (now)",
        "model.path: '/models/qwen2-0.5b' (checkpoint) vs '/models/llama-1b' (now)"]
    assert "trainer.resume=never" in str(info.value)
    assert check_compatible(SAVED, _with(**{"model.path": "/moved/qwen2-0.5b"}), allow=["model.path"]) == []


def test_other_data_batch_size_is_refused():
    with pytest.raises(IncompatibleCheckpoint, match="data.train_batch_size: 32 \\(checkpoint\\) vs 64"):
        check_compatible(SAVED, _with(**{"data.train_batch_size": 64}))


def test_missing_key_is_named():
    new = _with()
    del new["model"]["tokenizer_path"]
    with pytest.raises(IncompatibleCheckpoint, match="model.tokenizer_path: None \\(checkpoint\\) vs '<absent>'"):
        check_compatible(SAVED, new)


def test_saved_run_config_round_trips_as_compatible(tmp_path):
    from hybridflow.config import load_config

    cfg = load_config(["model.path=/models/qwen2", "trainer.n_workers=2"])
    save_controller_state(tmp_path, 3, cfg)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert check_compatible(saved, cfg) == []
    resumed = load_config(["model.path=/models/qwen2", "trainer.n_workers=1", "actor.lr=3e-6"])
    assert check_compatible(saved, resumed) == ["actor.lr: 1e-06 (checkpoint) vs 3e-06 (now)"]


def test_model_config_architecture_change_is_refused():
    saved = {"model_type": "qwen2", "vocab_size": 260, "hidden_size": 64, "num_hidden_layers": 2}
    check_model_config(saved, dict(saved, torch_dtype="bfloat16"))
    with pytest.raises(IncompatibleCheckpoint, match=r"actor model vocab_size: 260 \(checkpoint\) vs 300 \(now\)"):
        check_model_config(saved, dict(saved, vocab_size=300))


def test_lora_rank_and_targets_must_match_and_their_absence_means_full_training():
    lora = {"rank": 8, "alpha": 16.0, "target_modules": []}
    saved = _with(**{"actor.lora": lora})
    with pytest.raises(IncompatibleCheckpoint, match="actor.lora.rank: 8 \\(checkpoint\\) vs 16 \\(now\\)"):
        check_compatible(saved, _with(**{"actor.lora": {**lora, "rank": 16}}))
    with pytest.raises(IncompatibleCheckpoint, match="actor.lora.target_modules: \\[\\] \\(checkpoint\\) vs"):
        check_compatible(saved, _with(**{"actor.lora": {**lora, "target_modules": ["q_proj"]}}))
    assert check_compatible(saved, _with(**{"actor.lora": {**lora, "alpha": 8.0}})) == [
        "actor.lora.alpha: 16.0 (checkpoint) vs 8.0 (now)"]
    # a checkpoint saved before LoRA existed trained every weight: resumable without LoRA, not with it
    assert check_compatible(SAVED, _with(**{"actor.lora": {"rank": 0, "target_modules": []}})) == []
    with pytest.raises(IncompatibleCheckpoint, match="actor.lora.rank: '<absent>' \\(checkpoint\\) vs 8"):
        check_compatible(SAVED, saved)
