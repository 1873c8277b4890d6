"""What each training command checks first, before it opens its output directory or reads a data row: `hybridflow
config --command C` runs exactly the checks `hybridflow C` runs first (the same functions its trainer calls:
`validate` in `RLTrainer`, `validate_sft` in `SFTTrainer`, `validate_preference` in `PreferenceTrainer`), and
`hybridflow migrate` loads a recipe with the command's schema.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.loader import load_config
from hybridflow.config.preference_schema import DPOConfig, RewardModelTrainConfig, preference_problems
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.validate import validate, validate_sft


def validate_preference(cfg: Any) -> None:
    """`hybridflow dpo`'s and `hybridflow rm`'s checks: SFT's, with a pair's two sequences in one micro-batch, and
    the preference sections' own; one `ConfigError` lists them all."""
    validate_sft(cfg, rows_per_example=2, more=preference_problems(cfg))


# command -> (its config schema, the checks its trainer runs before any model loads)
COMMANDS: dict[str, tuple[type, Callable[[Any], None]]] = {"train": (RLConfig, validate),
                                                           "sft": (SFTConfig, validate_sft),
                                                           "dpo": (DPOConfig, validate_preference),
                                                           "rm": (RewardModelTrainConfig, validate_preference)}


def check_config(command: str, overrides: Sequence[str], config_file: str | Path | None,
                 checks: bool = True) -> Any:
    """The config of `command` built from `config_file` and `overrides`, once it passes the checks the command
    runs first (`checks=False`: only the loader's, of keys, types and choices); raises one `ConfigError` listing
    every problem otherwise. Not run here: what a trainer checks after them (the output directory, the resume
    checkpoint, each data row)."""
    schema, validate_command = COMMANDS[command]
    cfg = load_config(overrides, config_file, schema=schema)
    if checks:
        validate_command(cfg)
    return cfg
