"""The Weights & Biases logger (imported lazily; ``WANDB_MODE=offline`` logs with no network).

In offline mode the run is written under ``<output_dir>/wandb`` and can be uploaded later with
``wandb sync <output_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "trainer.loggers includes 'wandb' but the wandb package is not installed: pip install wandb "
            "(set WANDB_MODE=offline to log without a network or an account), or drop 'wandb' from "
            "trainer.loggers"
        ) from e
    return wandb


class WandbLogger:
    """One W&B run: metrics with ``run.log(..., step=step)``, samples as a ``wandb.Table``."""

    def __init__(self, output_dir: str | Path, project: str = "hybridflow", experiment: str | None = None,
                 config: dict | None = None, **_: Any) -> None:
        self.wandb = _import_wandb()
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project, name=experiment, config=config or {}, dir=str(output_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, samples: list[dict], step: int) -> None:
        columns = list(dict.fromkeys(k for s in samples for k in s))
        data = [[v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                 for v in (s.get(c) for c in columns)] for s in samples]
        table = self.wandb.Table(columns=columns, data=data)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
