"""The run report: PNG plots of a run's metrics against step and one HTML page with them, the config and
sample completions.

    hybridflow report outputs/grpo_tiny                  # -> outputs/grpo_tiny/report.html (+ report/*.png)
    hybridflow report outputs/grpo_tiny --out /tmp/run.html

    from hybridflow.report import write_report
    page = write_report("outputs/grpo_tiny")

It reads what any `hybridflow train` run writes (`metrics.jsonl`, `samples.jsonl`, the config in its
checkpoints; see `runlog`), so it works on a finished run, a crashed one, or one still training.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.report.html import render
from hybridflow.report.plots import PLOTS, Plot, PlotSpec, write_plots
from hybridflow.report.runlog import ReportError, RunLog, load_run

__all__ = ["PLOTS", "Plot", "PlotSpec", "ReportError", "RunLog", "load_run", "write_plots", "write_report"]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the report of `run_dir` and returns the HTML file's path.

    `out`: the HTML file (default `<run_dir>/report.html`); the PNGs go to a folder named after it
    (`report/` next to `report.html`), and the page embeds them, so it stands on its own.
    Raises `ReportError` when `run_dir` is missing or has no metrics.jsonl.
    """
    run = load_run(run_dir)
    page = Path(out).expanduser() if out is not None else run.run_dir / "report.html"
    if page.suffix.lower() not in (".html", ".htm"):
        raise ReportError(f"--out {page}: the report is an HTML page; give a file name ending in .html")
    plots = write_plots(run, page.with_suffix(""))
    page.write_text(render(run, plots), encoding="utf-8")
    return page
