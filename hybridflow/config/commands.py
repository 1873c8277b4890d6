"""Each training command's config schema and its config checks (`COMMANDS`): `validate` for `hybridflow train`,
`validate_sft` for `sft`, `validate_preference` for `dpo` and `rm`, each the one its trainer calls first (in
`RLTrainer`, `SFTTrainer`, `PreferenceTrainer`). `hybridflow config --command C` runs them among every check the
command makes before any model loads (`hybridflow.trainer.preflight`), and `hybridflow migrate` loads a recipe with
the command's schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config.preference_schema import DPOConfig, RewardModelTrainConfig, preference_problems
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.validate import validate, validate_sft


def validate_preference(cfg: Any) -> None:
    """`hybridflow dpo`'s and `hybridflow rm`'s checks: SFT's, with a pair's two sequences in one micro-batch, and
    the preference sections' own; one `ConfigError` lists them all."""
    validate_sft(cfg, rows_per_example=2, more=preference_problems(cfg))


# command -> (its config schema, the checks of the config its trainer runs first)
COMMANDS: dict[str, tuple[type, Callable[[Any], None]]] = {"train": (RLConfig, validate),
                                                           "sft": (SFTConfig, validate_sft),
                                                           "dpo": (DPOConfig, validate_preference),
                                                           "rm": (RewardModelTrainConfig, validate_preference)}
