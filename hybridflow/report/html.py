"""The run report's HTML page: a summary table, the plots, the config and sample completions.

The page is one self-contained file (plots embedded as base64 PNG, CSS inline, no scripts), so it can be
mailed or attached to an issue on its own. Every piece of run text (prompts, responses, config values)
is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
from typing import Any

import yaml

from hybridflow.report.plots import Plot
from hybridflow.report.runlog import RunLog

SUMMARY_METRICS = ("reward/mean", "val/reward/mean", "response_length/mean", "actor/entropy", "actor/kl_loss",
                   "actor/pg_loss", "critic/vf_loss", "timing_s/step", "perf/throughput")

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1320px; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; } td, th { border: 1px solid #ddd; padding: 4px 8px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 12px; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #eee; }
figcaption { color: #666; font-size: 0.85em; }
pre { background: #f7f7f7; padding: 8px; white-space: pre-wrap; word-break: break-word; margin: 0; }
pre.config { max-height: 36em; overflow: auto; }
table.samples { width: 100%; } table.samples td { vertical-align: top; } td.text { width: 45%; }
.warn { color: #a40; } .note { color: #888; font-style: italic; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"


def summary_rows(run: RunLog) -> list[tuple[str, float, float, float, float, int]]:
    """`(metric, first, last, min, max, count)` for the headline metrics the run logged."""
    rows = []
    for key in SUMMARY_METRICS:
        _, values = run.series(key)
        if values:
            rows.append((key, values[0], values[-1], min(values), max(values), len(values)))
    return rows


def _summary(run: RunLog) -> str:
    steps = [s for s in run.steps if s > 0]
    train_s = sum(run.series("timing_s/step")[1])
    val_s = sum(run.series("timing_s/val")[1])
    facts = [("run directory", _e(run.run_dir)), ("training steps logged", f"{len(steps)}"
             + (f" (last: {steps[-1]})" if steps else "")),
             ("time in training steps", f"{train_s / 60:.1f} min"), ("time in validation", f"{val_s / 60:.1f} min")]
    head = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    body = "".join(f"<tr><td>{_e(k)}</td>" + "".join(f'<td class="num">{_fmt(v)}</td>' for v in vals)
                   + f'<td class="num">{n}</td></tr>' for k, *vals, n in summary_rows(run))
    table = ("<table><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th><th>points</th></tr>"
             f"{body}</table>") if body else "<p>No headline metrics were logged.</p>"
    return f"<table>{head}</table>{table}"


def _plots(plots: list[Plot]) -> str:
    if not plots:
        return "<p>No plottable metrics were logged.</p>"
    items = []
    for plot in plots:
        data = base64.b64encode(plot.png).decode("ascii")
        items.append(f'<figure><img alt="{_e(plot.title)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{_e(', '.join(plot.metrics))} &mdash; {_e(plot.path.name)}</figcaption></figure>")
    return f'<div class="plots">{"".join(items)}</div>'


def _config(run: RunLog) -> str:
    if run.config is None:
        return ("<p>config not recorded (no complete checkpoint with a config.yaml, and no config.yaml at the "
                "top of the run directory)</p>")
    text = yaml.safe_dump(run.config, sort_keys=False, default_flow_style=False)
    return f"<p>from {_e(run.config_source)}</p><pre class=\"config\">{_e(text)}</pre>"


def _samples(run: RunLog, max_steps: int) -> str:
    """The samples of the first logged step and the last `max_steps - 1` (before vs. after training)."""
    if not run.samples:
        return "<p>No samples were logged (samples are logged at each validation; see trainer.log_samples).</p>"
    by_step: dict[Any, list[dict]] = {}
    for row in run.samples:
        by_step.setdefault(row.get("step"), []).append(row)
    steps = list(by_step)
    shown = steps if len(steps) <= max_steps else [steps[0], *steps[-(max_steps - 1):]]
    parts = []
    if len(shown) < len(steps):
        parts.append(f"<p>Showing {len(shown)} of {len(steps)} logged steps: the first and the latest.</p>")
    for step in shown:
        rows = "".join(
            f'<tr><td class="num">{_fmt(_float(r.get("reward")))}</td><td>{_e(r.get("data_source", ""))}</td>'
            f'<td class="text">{_shown(r.get("prompt"))}</td><td class="text">{_shown(r.get("response"))}</td></tr>'
            for r in by_step[step])
        parts.append(f'<h3>step {_e(step)}</h3><table class="samples"><tr><th>reward</th><th>data source</th>'
                     f"<th>prompt</th><th>response</th></tr>{rows}</table>")
    return "".join(parts)


def _shown(text: Any, max_chars: int = 2000) -> str:
    """Run text for a sample cell: escaped, cut at `max_chars`; whitespace-only text shown escaped
    (`'\\n\\n'`), so a model that emits only newlines is visible, not an empty box."""
    text = "" if text is None else str(text)
    if not text.strip():
        return f'<span class="note">{_e(repr(text)[:max_chars]) if text else "(empty)"}</span>'
    cut = f'<span class="note"> … {len(text) - max_chars} more characters</span>' if len(text) > max_chars else ""
    return f"<pre>{_e(text[:max_chars])}</pre>{cut}"


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def render(run: RunLog, plots: list[Plot], max_sample_steps: int = 6) -> str:
    """The whole report page as an HTML string."""
    title = f"hybridflow run report: {run.run_dir.name}"
    warn = ""
    if run.unreadable:
        warn = (f'<p class="warn">Skipped {len(run.unreadable)} unreadable line(s): '
                f"{_e(', '.join(run.unreadable[:10]))}{' ...' if len(run.unreadable) > 10 else ''}</p>")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
            f'<p class="sub">made by <code>hybridflow report {_e(run.run_dir)}</code></p>{warn}'
            f"<h2>Summary</h2>{_summary(run)}<h2>Plots</h2>{_plots(plots)}"
            f"<h2>Sample completions</h2>{_samples(run, max_sample_steps)}"
            f"<h2>Config</h2>{_config(run)}</body></html>\n")
