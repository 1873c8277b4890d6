"""`Tracker`: one `log(metrics, step)` call fanned out to the chosen loggers.

    with Tracker(["console", "jsonl", "tensorboard"], output_dir="outputs/run", config=cfg) as tracker:
        tracker.log({"reward/mean": 0.5, "actor/pg_loss": -0.01}, step=1)
        tracker.log_samples([{"prompt": p, "response": r, "reward": 1.0, "data_source": "gsm8k"}], step=1)

Values may be Python numbers, 0-d tensors or numpy scalars (turned into Python numbers) or strings. With
`aliases` (the trainers pass it), each metric verl or TRL knows by another name is logged under that name
too (`hybridflow.tracking.aliases`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from hybridflow.tracking.aliases import with_aliases
from hybridflow.tracking.console_logger import ConsoleLogger
from hybridflow.tracking.jsonl_logger import JsonlLogger
from hybridflow.tracking.tensorboard_logger import TensorBoardLogger
from hybridflow.tracking.wandb_logger import WandbLogger

LOGGERS = {
    "console": ConsoleLogger,
    "jsonl": JsonlLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
}


def _plain(value: Any) -> Any:
    """A Python number or string from a metric value (0-d tensor, numpy scalar, number, string)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value of type {type(value).__name__} is not a number or a string: {value!r:.80}")


def config_dict(config: Any) -> dict:
    """A plain dict from a dataclass, an OmegaConf config, a mapping, or None."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        container = OmegaConf.to_container(config, resolve=True)
        if not isinstance(container, dict):
            raise TypeError(f"a run's config is a mapping, not a {type(container).__name__}")
        return container
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a dataclass, an OmegaConf config or a mapping, got {type(config).__name__}")


def _check_names(loggers: Iterable[str] | str) -> list[str]:
    names = [s.strip() for s in loggers.split(",")] if isinstance(loggers, str) else list(loggers)
    for name in names:
        if name not in LOGGERS:
            hint = difflib.get_close_matches(name, list(LOGGERS), n=1)
            raise ValueError(f"unknown logger {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             + f"; valid: {', '.join(LOGGERS)}")
    return list(dict.fromkeys(names))


class Tracker:
    """Fans metrics and samples out to loggers.

    Args:
        loggers: names from `LOGGERS` (a list, or a comma-separated string).
        output_dir: where ``metrics.jsonl``, ``samples.jsonl``, ``tensorboard/`` and ``wandb/`` go.
        project: project name (W&B).
        experiment: run name (W&B); default: the last component of `output_dir`.
        config: the run config (a dataclass, OmegaConf config or mapping), recorded by TensorBoard and W&B.
        total_steps: shown by the console line as ``step i/total``.
        stream: the console logger's stream (default stdout).
        aliases: log verl's and TRL's names beside ours, with these fields for the alias templates (``val_n``;
            `hybridflow.tracking.aliases`); None = ours only.
    """

    def __init__(self, loggers: Iterable[str] | str = ("console", "jsonl"), output_dir: str | Path = "outputs/run",
                 project: str = "hybridflow", experiment: str | None = None, config: Any = None,
                 total_steps: int | None = None, stream: TextIO | None = None,
                 aliases: Mapping[str, Any] | None = None) -> None:
        self.names = _check_names(loggers)
        self.aliases = None if aliases is None else dict(aliases)
        self.output_dir = Path(output_dir)
        options = dict(output_dir=self.output_dir, project=project, experiment=experiment or self.output_dir.name,
                       config=config_dict(config), total_steps=total_steps, stream=stream)
        self.backends: dict[str, Any] = {}
        try:
            for name in self.names:
                self.backends[name] = LOGGERS[name](**options)
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Logs one step's metrics (with their aliases when the tracker has them) to every logger."""
        plain = {str(k): _plain(v) for k, v in metrics.items()}
        if self.aliases is not None:
            plain = with_aliases(plain, self.aliases)
        for backend in self.backends.values():
            backend.log(plain, int(step))

    def log_samples(self, samples: list[dict], step: int) -> None:
        """Logs sample completions (dicts with ``prompt``, ``response``, ``reward``, ``data_source``)."""
        if samples:
            rows = [{str(k): _plain(v) if not isinstance(v, (list, dict)) else v for k, v in s.items()}
                    for s in samples]
            for backend in self.backends.values():
                backend.log_samples(rows, int(step))

    def log_rollouts(self, records: list[dict], step: int) -> None:
        """Appends a step's token-level records (`rollout_records`) to ``rollouts.jsonl``; only the jsonl
        logger keeps them (they are for `hybridflow view`, not for dashboards)."""
        jsonl = self.backends.get("jsonl")
        if records and jsonl is not None:
            jsonl.log_rollouts(records, int(step))

    def close(self) -> None:
        """Flushes and closes every logger (safe to call twice)."""
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
