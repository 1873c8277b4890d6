"""`preflight`: every check a training command makes before any model loads, all of them run and nothing written,
every problem reported in one `ConfigError`; `check_config`, behind `hybridflow config --command C`, loads a config
and runs it.

The checks, in the order the command's trainer makes them (`hybridflow.trainer.base.Trainer.__init__`, which stops
at the first problem, and alone writes):

1. the config's own checks (`hybridflow.config.commands.COMMANDS`: batch sizes, ranges, model and data paths, the
   reward functions, packages, ...);
2. the output directory: writable, with room for one checkpoint (`check_writable(create=False)`: not made);
3. its lock: no live run holds it (`check_unlocked`: tried, not taken);
4. its checkpoints: the one to resume from found, verified and compatible with the config, none that this run
   would mix with (`open_checkpoints(dry=True)`: none set aside or deleted);
5. the tokenizer, and every data row (the trainer's `build_loaders`: columns, messages, lengths, rows enough for
   a batch); each dataset names its first bad row, as the run would;
6. the trainer's checks of the data (`check_data`; RL: what the reward functions need of each dataset).

What the worker groups check as they start (their placement on this machine's GPUs or a Ray cluster, the device
plan's memory) is not run here.

Later checks read what the config names, so a problem the config's checks found could be reported twice or make a
later check fail: the data are not read while a data file is missing, nor the resume checkpoint while its path
does not exist; and once the config's checks found problems, a later check that fails with an error other than a
refusal (the tokenizer of a model directory that does not exist) is taken to follow from them and left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hybridflow.checkpoint import CheckpointError, IncompatibleCheckpoint, check_unlocked, check_writable
from hybridflow.config.commands import COMMANDS
from hybridflow.config.input_checks import data_file_problems, resume_problems
from hybridflow.config.loader import load_config
from hybridflow.config.validate import ConfigError, raise_if_any
from hybridflow.data.files import DataError
from hybridflow.trainer.base import Trainer, load_tokenizer
from hybridflow.trainer.checkpointing import base_fingerprints, open_checkpoints
from hybridflow.trainer.preference_trainer import DPOTrainer, RewardModelTrainer
from hybridflow.trainer.rl import RLTrainer
from hybridflow.trainer.sft_trainer import SFTTrainer

T = TypeVar("T")

TRAINERS: dict[str, type[Trainer]] = {"train": RLTrainer, "sft": SFTTrainer, "dpo": DPOTrainer,
                                      "rm": RewardModelTrainer}

# what a check raises to refuse a run (the command line prints it as one message and exits 2)
REFUSALS = (ConfigError, DataError, CheckpointError, IncompatibleCheckpoint)


class Problems:
    """The problems found so far; `check` runs one check and keeps what it refused. `config_refused`: the config's
    checks found problems, which a later check's other errors are taken to follow from."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.config_refused = False

    def check(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """`fn(*args, **kwargs)`, or None when it raised: a refusal is kept (each problem a `ConfigError` lists);
        another error is raised again, unless `config_refused`."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            self.found += e.problems
        except REFUSALS as e:
            self.found.append(str(e))
        except Exception:
            if not self.config_refused:
                raise
        return None


def preflight(command: str, cfg: Any) -> None:
    """Makes every check `hybridflow <command>` makes on `cfg` before any model loads (see the module docstring),
    writing nothing; raises one `ConfigError` listing every problem found."""
    trainer = TRAINERS[command]
    problems = Problems()
    problems.check(COMMANDS[command][1], cfg)
    problems.config_refused = bool(problems.found)
    size = problems.check(trainer.checkpoint_size, cfg) or 0  # 0: unknown, a model the config's checks refused
    problems.check(check_writable, cfg.trainer.output_dir, size, create=False)
    problems.check(check_unlocked, cfg.trainer.output_dir)
    if not resume_problems(cfg):  # a path that does not exist: the config's checks named it
        problems.check(lambda: open_checkpoints(cfg, trainer.model_role, trainer.model_head,
                                                base_fingerprints(trainer.lora_bases(cfg)), dry=True))
    tokenizer = problems.check(load_tokenizer, cfg.model)
    if tokenizer is not None and not data_file_problems(cfg):  # a missing file: the config's checks named it
        loaders = problems.check(trainer.build_loaders, cfg, tokenizer)
        if loaders is not None:
            problems.check(trainer.check_data, cfg, *loaders)
    raise_if_any(problems.found)


def check_config(command: str, overrides: Sequence[str], config_file: str | Path | None, checks: bool = True) -> Any:
    """The config of `command` built from `config_file` and `overrides`, once it passes every check the command makes
    before any model loads (`preflight`; `checks=False`: only the loader's, of keys, types and choices); raises one
    `ConfigError` listing every problem otherwise."""
    cfg = load_config(overrides, config_file, schema=COMMANDS[command][0])
    if checks:
        preflight(command, cfg)
    return cfg
