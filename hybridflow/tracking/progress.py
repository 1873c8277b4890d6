"""`ProgressBar`: a tqdm bar over training steps with ETA and the last reward.

Disabled automatically when stderr is not a terminal (CI logs, files) or when asked, in which case the
console logger's per-step line is the only progress output.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm


class ProgressBar:
    """Progress over steps ``initial..total``.

    Args:
        total: the last step.
        initial: the step the run starts from (a resumed run); the rate and ETA count only new steps.
        disable: True to hide, False to force, None for "only on a terminal".
        stream: where the bar is drawn (default stderr).
    """

    def __init__(self, total: int, initial: int = 0, disable: bool | None = None, desc: str = "train",
                 stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        if disable is None:
            disable = not (hasattr(stream, "isatty") and stream.isatty())
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=stream, disable=disable,
                        dynamic_ncols=True)

    @property
    def disabled(self) -> bool:
        return bool(self.bar.disable)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Moves the bar to `step` and shows the step's reward (``reward/mean``) when present."""
        if metrics and "reward/mean" in metrics:
            self.bar.set_postfix(reward=f"{float(metrics['reward/mean']):.3f}", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
