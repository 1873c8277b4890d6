"""The TensorBoard logger: scalars, the run config and sample completions under ``<output_dir>/tensorboard``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def samples_markdown(samples: list[dict]) -> str:
    """A markdown table of samples (columns: the union of their keys, in first-seen order)."""
    columns = list(dict.fromkeys(k for s in samples for k in s))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(s.get(c, "")) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


class TensorBoardLogger:
    """Writes each numeric metric with ``SummaryWriter.add_scalar`` and flushes after every step."""

    def __init__(self, output_dir: str | Path, config: dict | None = None, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, samples: list[dict], step: int) -> None:
        self.writer.add_text("samples", samples_markdown(samples), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
