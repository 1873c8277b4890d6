"""The console logger: one compact line per step with the metrics a person watches (an SFT step's
``loss``/``val_loss``; a DPO or reward-model step's ``margin`` and pair accuracy ``pair_acc`` / ``val_pair_acc``;
an RL step's as below, with ``teacher_kl`` when distilling).

    step  12/200 | reward 0.531 | val 0.550 | pg_loss -0.0123 | vf_loss 0.412 | kl 0.0012 | entropy 2.31
      | grad 1.23 | lr 1e-06 | len 87.4 (max 256, clip 3.1%) | 4.21 s | 1,234 tok/s | reward errors 6%
      | env errors 25%

(all on one line). Only metrics present in the step are shown (the error shares only when above 0: the
share of rows whose reward function failed, of trajectories whose environment failed); the line is written with
``tqdm.write`` so it stays above a progress bar.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm


def _num(v: float) -> str:
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


# (metric key, label, formatter)
FIELDS: list[tuple[str, str, Callable[[float], str]]] = [
    ("train/loss", "loss", _num),
    ("val/loss", "val_loss", _num),
    ("reward/mean", "reward", lambda v: f"{v:.3f}"),
    ("val/reward/mean", "val", lambda v: f"{v:.3f}"),
    ("dpo/margin", "margin", _num),
    ("dpo/accuracy", "pair_acc", lambda v: f"{v:.3f}"),
    ("val/dpo/accuracy", "val_pair_acc", lambda v: f"{v:.3f}"),
    ("rm/accuracy", "pair_acc", lambda v: f"{v:.3f}"),
    ("val/rm/accuracy", "val_pair_acc", lambda v: f"{v:.3f}"),
    ("teacher/kl", "teacher_kl", _num),
    ("actor/pg_loss", "pg_loss", _num),
    ("critic/vf_loss", "vf_loss", _num),
    ("actor/kl_loss", "kl", _num),
    ("actor/ppo_kl", "ppo_kl", _num),
    ("actor/entropy", "entropy", _num),
    ("actor/grad_norm", "grad", _num),
    ("actor/lr", "lr", lambda v: f"{v:.2g}"),
]


def format_line(metrics: dict[str, Any], step: int, total_steps: int | None = None) -> str:
    """The one-line summary of a step's `metrics` (see the module docstring)."""
    width = len(str(total_steps)) if total_steps else 0
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"]
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    parts += [f"{label} {fmt(numeric[key])}" for key, label, fmt in FIELDS if key in numeric]
    if "response_length/mean" in numeric:
        length = f"len {numeric['response_length/mean']:.1f}"
        details = [f"max {numeric['response_length/max']:.0f}"] if "response_length/max" in numeric else []
        if "response_length/clip_ratio" in numeric:
            details.append(f"clip {100 * numeric['response_length/clip_ratio']:.1f}%")
        parts.append(length + (f" ({', '.join(details)})" if details else ""))
    if "timing_s/step" in numeric:
        parts.append(f"{numeric['timing_s/step']:.2f} s")
    if "perf/throughput" in numeric:
        parts.append(f"{numeric['perf/throughput']:,.0f} tok/s")
    for key, label in (("reward/error_share", "reward errors"), ("agent/env_error_share", "env errors")):
        if numeric.get(key):
            parts.append(f"{label} {100 * numeric[key]:.0f}%")
    return " | ".join(parts)


class ConsoleLogger:
    """Writes `format_line` per step, and validation samples truncated to `sample_chars`."""

    def __init__(self, total_steps: int | None = None, stream: TextIO | None = None, sample_chars: int = 200,
                 **_: Any) -> None:
        self.total_steps, self.stream, self.sample_chars = total_steps, stream, sample_chars

    def _write(self, text: str) -> None:
        tqdm.write(text, file=self.stream or sys.stdout)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._write(format_line(metrics, step, self.total_steps))

    def log_samples(self, samples: list[dict], step: int) -> None:
        for i, sample in enumerate(samples):
            response = str(sample.get("response", "")).replace("\n", "\\n")
            if len(response) > self.sample_chars:
                response = response[: self.sample_chars] + "..."
            self._write(f"  sample {i} [{sample.get('data_source', '')}] reward {sample.get('reward', float('nan')):.3f}: "
                        f"{response}")

    def close(self) -> None:
        pass
