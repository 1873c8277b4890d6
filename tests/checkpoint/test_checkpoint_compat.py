"""Resume compatibility: another model refused with the key named; world sizes and run length may differ."""

from __future__ import annotations

import pytest

from hybridflow.checkpoint import IncompatibleCheckpoint, check_compatible, check_model_config
from hybridflow.checkpoint.compat import diff_configs, flatten

SAVED = {
    "actor": {"model": {"path": "/models/qwen2-0.5b"}, "optim": {"lr": 1e-6}, "world_size": 2},
    "data": {"train_files": ["a.parquet"], "max_prompt_length": 512},
    "trainer": {"total_steps": 100, "output_dir": "/runs/a", "logger": ["console"], "save_every": 10},
}


def _with(**changes):
    new = flatten(SAVED)
    new.update(changes)
    nested: dict = {}
    for key, value in new.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def test_same_config_is_compatible():
    assert check_compatible(SAVED, _with()) == []


def test_world_size_run_length_and_logging_may_differ():
    new = _with(**{"actor.world_size": 1, "trainer.total_steps": 400, "trainer.logger": ["console", "jsonl"],
                   "trainer.output_dir": "/runs/b", "trainer.save_every": 50})
    assert check_compatible(SAVED, new) == []


def test_other_changes_are_reported_not_refused():
    changed = check_compatible(SAVED, _with(**{"actor.optim.lr": 2e-6}))
    assert changed == ["actor.optim.lr: 1e-06 (checkpoint) vs 2e-06 (now)"]


def test_another_model_is_refused_with_key_and_values():
    with pytest.raises(IncompatibleCheckpoint) as info:
        check_compatible(SAVED, _with(**{"actor.model.path": "/models/llama-1b", "actor.optim.lr": 2e-6}))
    assert info.value.differences == ["actor.model.path: '/models/qwen2-0.5b' (checkpoint) vs "
                                      "'/models/llama-1b' (now)"]
    assert "trainer.resume=never" in str(info.value)
    assert check_compatible(SAVED, _with(**{"actor.model.path": "/moved/qwen2-0.5b"}),
                            allow=["actor.model.path"]) == []


def test_missing_key_is_named():
    assert diff_configs({"a": {"b": 1, "c": 2}}, {"a": {"c": 2}, "d": 3}) == {"a.b": (1, "<absent>"),
                                                                             "d": ("<absent>", 3)}


def test_model_config_architecture_change_is_refused():
    saved = {"model_type": "qwen2", "vocab_size": 260, "hidden_size": 64, "num_hidden_layers": 2}
    check_model_config(saved, dict(saved, torch_dtype="bfloat16"))
    with pytest.raises(IncompatibleCheckpoint, match=r"actor model vocab_size: 260 \(checkpoint\) vs 300 \(now\)"):
        check_model_config(saved, dict(saved, vocab_size=300))
