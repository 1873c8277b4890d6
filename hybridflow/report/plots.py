"""The run report's plots: which metrics each one shows, and drawing them to PNG against step.

Each `PlotSpec` names its metrics (exact names, plus an optional regular expression for families such
as the per-source `val/<data_source>/reward/mean`); a metric the run never logged is left out, and a
plot with none of its metrics is skipped, so a run without a critic simply has no critic plot. The
per-phase time breakdown (`timing_s/<phase>`) is a stacked bar per step, its remainder up to
`timing_s/step` drawn as "other".

Figures are made with `matplotlib.figure.Figure` on the Agg canvas: no pyplot, no global state, no
display needed.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

from hybridflow.report.runlog import RunLog

TIMING_PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                 "update_weights")


@dataclass(frozen=True)
class PlotSpec:
    """One plot: `keys` drawn in order, then any other metric matching `pattern`; `stacked` draws
    stacked bars per step (with the remainder up to `total` as "other") instead of lines."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    pattern: str | None = None
    log_y: bool = False
    stacked: bool = False
    total: str | None = None


PLOTS = (
    PlotSpec("reward", "Training reward", "reward", ("reward/mean", "reward/max", "reward/min",
                                                     "reward/with_kl/mean")),
    PlotSpec("validation", "Validation score", "score", ("val/reward/mean",), pattern=r"^val/.+/reward/mean$"),
    PlotSpec("response_length", "Response length", "tokens", ("response_length/mean", "response_length/max",
                                                              "response_length/min")),
    PlotSpec("kl", "KL to the reference / old policy", "KL", ("actor/kl_loss", "actor/ppo_kl",
                                                              "actor/reward_kl_penalty")),
    PlotSpec("entropy", "Policy entropy", "nats per token", ("actor/entropy",)),
    PlotSpec("timing", "Time per step, by phase", "seconds", tuple(f"timing_s/{p}" for p in TIMING_PHASES),
             stacked=True, total="timing_s/step"),
    PlotSpec("policy_loss", "Policy loss and clipping", "value", ("actor/pg_loss", "actor/pg_clipfrac")),
    PlotSpec("critic", "Critic", "value", ("critic/vf_loss", "critic/vf_clipfrac", "values/mean")),
    PlotSpec("grad_norm", "Gradient norm (before clipping)", "norm", ("actor/grad_norm", "critic/grad_norm"),
             log_y=True),
    PlotSpec("throughput", "Throughput", "tokens / s / device", ("perf/throughput",)),
)


@dataclass
class Plot:
    """A drawn plot: its file, PNG bytes and the metric names it shows."""

    name: str
    title: str
    path: Path
    png: bytes
    metrics: list[str]


def _keys_of(spec: PlotSpec, available: set[str]) -> list[str]:
    keys = [k for k in spec.keys if k in available]
    if spec.pattern:
        keys += sorted(k for k in available if re.match(spec.pattern, k) and k not in keys)
    return keys


def _new_axes(title: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    formatter = ax.yaxis.get_major_formatter()
    if isinstance(formatter, ScalarFormatter):  # matplotlib's default: no "+1e3" offset above the axis
        formatter.set_useOffset(False)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _lines(ax, run: RunLog, spec: PlotSpec, keys: list[str]) -> None:
    for i, key in enumerate(keys):
        steps, values = run.series(key)
        ax.plot(steps, values, label=key, linewidth=2.0 if i == 0 else 1.2, linestyle="-" if i == 0 else "--",
                marker="o" if len(steps) <= 30 else None, markersize=3)
    if spec.log_y and all(v > 0 for k in keys for v in run.series(k)[1]):
        ax.set_yscale("log")


def _stacked(ax, run: RunLog, spec: PlotSpec, keys: list[str]) -> None:
    steps = sorted({s for k in keys for s in run.series(k)[0]})
    width = 0.8 * (min(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1)
    bottom = [0.0] * len(steps)
    for key in keys:
        heights = [run.metrics[s].get(key, 0.0) for s in steps]
        ax.bar(steps, heights, width, bottom=bottom, label=key.rsplit("/", 1)[-1],
               color=f"C{spec.keys.index(key) % 10}")  # a phase keeps its colour across runs
        bottom = [b + h for b, h in zip(bottom, heights)]
    if spec.total:
        other = [max(run.metrics[s].get(spec.total, b) - b, 0.0) for s, b in zip(steps, bottom)]
        if any(other):
            ax.bar(steps, other, width, bottom=bottom, label="other", color="lightgray")


def draw(run: RunLog, spec: PlotSpec) -> tuple[bytes, list[str]] | None:
    """PNG bytes of `spec` over `run` and the metrics drawn; None when the run logged none of them."""
    keys = _keys_of(spec, run.keys())
    if not keys:
        return None
    fig, ax = _new_axes(spec.title, spec.ylabel)
    (_stacked if spec.stacked else _lines)(ax, run, spec, keys)
    if spec.stacked:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.legend(fontsize="small")
    return _png(fig), keys


def write_plots(run: RunLog, out_dir: Path) -> list[Plot]:
    """Draws every plot the run has metrics for into `out_dir/<name>.png`; returns them in report order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for spec in PLOTS:
        result = draw(run, spec)
        if result is not None:
            path = out_dir / f"{spec.name}.png"
            path.write_bytes(result[0])
            plots.append(Plot(spec.name, spec.title, path, *result))
    return plots
