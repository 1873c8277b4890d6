"""May this checkpoint be resumed under this config? Refuse another model, name every difference.

Configs are compared as flattened dotted keys (`critic.model.path`, from `hybridflow.config.config_diff`),
matched against glob patterns:

- `MAY_DIFFER`: run length, logging, output paths, checkpoint cadence, validation, world sizes and
  memory/speed knobs. World sizes may change because DCP reshards model and optimizer state on load
  (2 → 1 workers, 4 → 8, ...); every FSDP2 layout can be resharded, so no world size is refused.
- `MUST_MATCH`: what identifies the model and its vocabulary (model / tokenizer paths, architecture,
  vocabulary size), which parameters train (LoRA's rank and target modules: its checkpoints hold the
  adapters alone) and the data-loader's batch size (its saved position counts batches). A difference
  here raises `IncompatibleCheckpoint` naming each key and both values.
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
    # run length, outputs, logging, checkpoint cadence
    "trainer.total_steps", "trainer.total_epochs", "trainer.output_dir", "trainer.resume",
    "trainer.save_every", "trainer.keep_checkpoints", "trainer.max_bad_steps", "trainer.loggers",
    "trainer.loggers.*", "trainer.project_name", "trainer.experiment_name", "trainer.log_samples",
    # validation only
    "trainer.val_every", "trainer.val_before_train", "data.val_files", "data.val_batch_size",
    "rollout.val_temperature", "rollout.val_n",
    # where and how many: DCP reshards model and optimizer state to any world size
    "trainer.backend", "trainer.device", "trainer.n_workers", "trainer.placement", "reward.num_workers", "ray.*",
    "*world_size", "*n_gpus*", "*nnodes",
    # memory and speed knobs that do not change what is computed
    "*param_offload", "*optimizer_offload", "*.micro_batch_size", "*.max_tokens_per_micro_batch",
    "*.gradient_checkpointing", "*.attn_implementation", "rollout.max_num_seqs",
    "rollout.kv_cache_fraction", "rollout.cuda_graphs", "rollout.free_cache_after_generate",
    "rollout.offload_weights", "trainer.device_memory_gib",
)
MUST_MATCH: tuple[str, ...] = (
    # which model and vocabulary the weights belong to
    "*model.path", "*tokenizer_path", "*model.name_or_path", "*vocab_size", "*architectures",
    "*model_type",
    # which parameters a checkpoint holds: every weight, or LoRA adapters of this rank on these modules
    "*.lora.rank", "*.lora.target_modules", "*.lora.target_parameters",
    # the data-loader position counts batches of this many prompts
    "data.train_batch_size",
)
# What a key absent from a checkpoint's config (saved before the key existed) stood for: runs then trained
# every weight.
ABSENT_MEANS: dict[str, Any] = {"*.lora.rank": 0, "*.lora.target_modules": [], "*.lora.target_parameters": []}
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


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in patterns)


def _meant_by_absence(key: str, value: Any) -> bool:
    """Is `value` what `key` stood for in a checkpoint saved before the key existed (`ABSENT_MEANS`)?"""
    return any(fnmatchcase(key, pattern) and value == meant for pattern, meant in ABSENT_MEANS.items())


def check_compatible(saved_config: Any, new_config: Any,
                     must_match: Iterable[str] = MUST_MATCH, may_differ: Iterable[str] = MAY_DIFFER,
                     allow: Iterable[str] = ()) -> list[str]:
    """Raise `IncompatibleCheckpoint` if a `must_match` key differs (unless it matches `allow`);
    return the other differences (not in `may_differ`) as "key: saved vs now" lines for the log.

    Configs are dataclasses (`RLConfig`) or nested mappings (the checkpoint's `config.yaml`); tuples
    and lists compare equal, so a YAML round trip is not a difference.
    """
    from hybridflow.config import config_diff  # here, so worker processes need no config stack

    must_match, may_differ, allow = tuple(must_match), tuple(may_differ), tuple(allow)
    fatal: list[str] = []
    changed: list[str] = []
    for key, (before, after) in sorted(config_diff(saved_config, new_config).items()):
        line = f"{key}: {before!r} (checkpoint) vs {after!r} (now)"
        if _matches(key, may_differ) or _matches(key, allow):
            continue
        if before == _ABSENT and _meant_by_absence(key, after):
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
