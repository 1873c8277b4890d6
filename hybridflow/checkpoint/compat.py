"""May this checkpoint be resumed under this config? Refuse another model, name every difference.

Configs are compared as flattened dotted keys (`actor.model.path`), matched against glob patterns:

- `MAY_DIFFER`: run length, logging, output paths, checkpoint cadence and world sizes. World sizes
  may change because DCP reshards model and optimizer state on load (2 → 1 workers, 4 → 8, ...).
- `MUST_MATCH`: what identifies the model and its vocabulary (model / tokenizer paths, architecture,
  vocabulary size). A difference here raises `IncompatibleCheckpoint` naming each key and both values.
- anything else that differs (learning rate, batch sizes, ...) is allowed but returned, so the
  trainer can log that the resumed run is not the same experiment.

`check_model_config` does the same for the Hugging Face configs of the saved and the new model, so a
model directory whose contents changed under the same path is refused too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any

MAY_DIFFER: tuple[str, ...] = (
    "trainer.total_steps", "trainer.total_epochs", "trainer.total_training_steps",
    "trainer.logger", "trainer.logger.*", "trainer.loggers", "trainer.loggers.*", "tracking.*",
    "trainer.project_name", "trainer.experiment_name", "trainer.run_name",
    "trainer.output_dir", "*.output_dir", "trainer.save_every", "trainer.keep_checkpoints",
    "trainer.resume", "trainer.val_every", "trainer.test_every", "trainer.log_every",
    "*world_size", "*n_gpus*", "*num_gpus*", "*gpus_per_node", "*nnodes", "*num_workers", "*.resources.*",
    "trainer.device", "*.backend",
)
MUST_MATCH: tuple[str, ...] = (
    "*model.path", "*model_path", "*model.name_or_path", "*tokenizer", "*tokenizer.path",
    "*tokenizer_path", "*vocab_size", "*architecture", "*architectures", "*model_type",
)
HF_ARCH_KEYS: tuple[str, ...] = (
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
    "tie_word_embeddings", "max_position_embeddings",
)
_ABSENT = "<absent>"


class IncompatibleCheckpoint(ValueError):
    """A resume was refused: the checkpoint's config differs where it must match."""

    def __init__(self, differences: list[str]):
        self.differences = differences
        super().__init__("cannot resume: the checkpoint was saved with an incompatible config:\n  "
                         + "\n  ".join(differences)
                         + "\nstart a fresh run (trainer.resume=never, or another trainer.output_dir), "
                           "or resume with the checkpoint's values")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in patterns)


def diff_configs(saved: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs: {key: (saved value, new value)}, absent as "<absent>"."""
    flat_saved, flat_new = flatten(saved), flatten(new)
    keys = sorted(set(flat_saved) | set(flat_new))
    return {key: (flat_saved.get(key, _ABSENT), flat_new.get(key, _ABSENT)) for key in keys
            if flat_saved.get(key, _ABSENT) != flat_new.get(key, _ABSENT)}


def check_compatible(saved_config: Mapping[str, Any], new_config: Mapping[str, Any],
                     must_match: Iterable[str] = MUST_MATCH, may_differ: Iterable[str] = MAY_DIFFER,
                     allow: Iterable[str] = ()) -> list[str]:
    """Raise `IncompatibleCheckpoint` if a `must_match` key differs (unless it matches `allow`);
    return the other differences (not in `may_differ`) as "key: saved -> new" lines for the log."""
    must_match, may_differ, allow = tuple(must_match), tuple(may_differ), tuple(allow)
    fatal, changed = [], []
    for key, (before, after) in diff_configs(saved_config, new_config).items():
        line = f"{key}: {before!r} (checkpoint) vs {after!r} (now)"
        if _matches(key, may_differ) or _matches(key, allow):
            continue
        (fatal if _matches(key, must_match) else changed).append(line)
    if fatal:
        raise IncompatibleCheckpoint(fatal)
    return changed


def check_model_config(saved_hf_config: Mapping[str, Any], new_hf_config: Mapping[str, Any],
                       role: str = "actor") -> None:
    """Refuse a model whose Hugging Face config differs from the saved one in an architecture key."""
    fatal = [f"{role} model {key}: {saved_hf_config.get(key, _ABSENT)!r} (checkpoint) vs "
             f"{new_hf_config.get(key, _ABSENT)!r} (now)"
             for key in HF_ARCH_KEYS if saved_hf_config.get(key, _ABSENT) != new_hf_config.get(key, _ABSENT)]
    if fatal:
        raise IncompatibleCheckpoint(fatal)
