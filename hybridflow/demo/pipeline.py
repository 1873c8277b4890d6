"""The demo pipeline behind `hybridflow demo` (and `make demo`): RL makes a tiny model better, offline.

    hybridflow demo [--output-dir outputs/demo]

1. **model** — a tiny Qwen2 (hidden 128, 4 layers, ~1M parameters) and a byte-level BPE tokenizer,
   built from scratch with `hybridflow.utils.tiny_model` and saved as a Hugging Face directory;
2. **data** — a procedural string task (`hybridflow.demo.tasks`): SFT conversations, RL prompts and
   held-out problems with disjoint questions;
3. **sft** — `hybridflow.trainer.sft_trainer.train_sft` with `SFT_SETTINGS` (the model learns the format and
   part of the task); the same as `hybridflow sft <SFT_SETTINGS> model.path=... data.train_files=...`;
4. **rl** — `hybridflow.trainer.rl.train` with `recipes/demo_grpo.yaml`: exactly what
   `hybridflow train --config recipes/demo_grpo.yaml ...` runs. Its validation on the held-out problems
   (greedy decoding, exact-match reward) before the first step and after the last one gives
   `accuracy_before_rl` (the SFT model) and `accuracy_after_rl` (the RL model): the same code, the same
   problems, the same decoding for both numbers;
5. **report** — `hybridflow report` on the RL run (`report.html` and its PNG plots).

`<output_dir>` gets `summary.json` (accuracies, per-phase minutes, sizes), the RL run's
`metrics.jsonl`, `tensorboard/`, `samples.jsonl` and checkpoints, and `model/`, `data/`, `sft/`.
`run_demo(..., size="smoke")` runs the same pipeline at a minuscule size for tests.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# The SFT warm-start, as `hybridflow sft` overrides of the SFTConfig defaults.
SFT_SETTINGS = ("data.train_batch_size=64", "data.max_length=64", "optim.lr=2e-3", "optim.lr_schedule=cosine",
                "optim.lr_warmup_steps=20", "optim.min_lr_ratio=0.1", "optim.weight_decay=0.0",
                "trainer.total_steps=400", "trainer.loggers=[console,jsonl]")


@dataclass(frozen=True)
class DemoSize:
    """How big each phase is; `sft` / `rl` are extra `key=value` overrides of the two recipes."""

    task: str = "reverse"
    min_len: int = 3
    max_len: int = 5
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    n_sft: int = 8192
    n_rl: int = 4096
    n_heldout: int = 200
    sft_noise: float = 0.65
    sft: tuple[str, ...] = ()
    rl: tuple[str, ...] = ()


SIZES = {
    "full": DemoSize(),
    "smoke": DemoSize(hidden=32, layers=1, heads=2, kv_heads=1, n_sft=32, n_rl=16, n_heldout=8,
                      sft=("data.train_batch_size=8", "trainer.total_steps=2", "optim.lr_warmup_steps=0"),
                      rl=("data.train_batch_size=4", "actor.mini_batch_size=4", "rollout.n=2",
                          "trainer.total_steps=2", "trainer.val_every=2", "data.max_response_length=4")),
}


# What a demo run writes under its output dir; a new run removes these first (the loggers append).
OUTPUTS = ("summary.json", "metrics.jsonl", "samples.jsonl", "tensorboard", "checkpoints", "report.html", "report",
           "sft", "model", "data")


def _clear_previous(out: Path) -> None:
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _accuracies(metrics_file: Path) -> tuple[float, float, list[tuple[int, float]]]:
    """(first validation score, last validation score, [(step, score)]) of a run's metrics.jsonl."""
    curve = [(row["step"], row["val/reward/mean"]) for row in map(json.loads, metrics_file.read_text().splitlines())
             if "val/reward/mean" in row]
    if len(curve) < 2:
        raise RuntimeError(f"{metrics_file} holds {len(curve)} validation score(s); the demo needs one before "
                           f"and one after RL (trainer.val_before_train=true, trainer.val_every > 0)")
    return curve[0][1], curve[-1][1], curve


def phase(title: str, what: str) -> None:
    """A header before each phase, so the console says which one the step lines belong to."""
    print(f"\n== demo {title}: {what} ==", flush=True)


def _decoding(temperature: float) -> str:
    return "greedy" if temperature <= 0 else f"sampled, temperature {temperature:g}, one sample per problem"


def _report(run_dir: Path) -> str:
    """Writes the run report (`hybridflow report <run_dir>`); returns its path, or why it failed."""
    from hybridflow.report import ReportError, write_report

    try:
        return str(write_report(run_dir))
    except ReportError as e:  # the numbers are still in summary.json; the demo does not fail for a plot
        return f"not written: {e}"


def run_demo(output_dir: str | Path = "outputs/demo", size: str | DemoSize = "full", seed: int = 1,
             sft_overrides: Sequence[str] = (), rl_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Runs the whole demo into `output_dir` and returns the summary it writes to `summary.json`.

    A previous demo's files there (`OUTPUTS`) are removed first; nothing else in the directory is touched.

    `size`: a `SIZES` name or a `DemoSize`; `*_overrides`: `key=value` applied last to each recipe.
    """
    from hybridflow.config.loader import load_config
    from hybridflow.config.sft_schema import SFTConfig
    from hybridflow.demo.tasks import write_task_data
    from hybridflow.trainer.rl import train
    from hybridflow.trainer.sft_trainer import train_sft
    from hybridflow.utils.tiny_model import build_tiny_model

    spec = SIZES[size] if isinstance(size, str) else size
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    minutes: dict[str, float] = {}
    start = last = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal last
        now = time.perf_counter()
        minutes[phase] = round((now - last) / 60, 3)
        last = now

    phase("1/4 data and model", f"the '{spec.task}' task's SFT, RL and held-out problems; a tiny Qwen2 "
                                f"(hidden {spec.hidden}, {spec.layers} layers) in {out}")
    files = write_task_data(out / "data", spec.task, spec.n_sft, spec.n_rl, spec.n_heldout, seed,
                            spec.min_len, spec.max_len, spec.sft_noise)
    lap("data")
    model = build_tiny_model(out / "model", "qwen2", spec.hidden, spec.layers, spec.heads, spec.kv_heads,
                             max_positions=128, seed=seed)
    lap("model")
    common = [f"trainer.seed={seed}", "trainer.resume=never"]
    phase("2/4 SFT", "supervised fine-tuning teaches the answer format and part of the task (loss per step)")
    train_sft(load_config([f"model.path={model}", f"data.train_files={files['sft']}",
                           f"trainer.output_dir={out / 'sft'}", *common, *SFT_SETTINGS, *spec.sft,
                           *sft_overrides], schema=SFTConfig))
    lap("sft")
    rl_cfg = load_config([f"model.path={out / 'sft' / 'hf'}", f"data.train_files={files['rl']}",
                          f"data.val_files={files['heldout']}", f"trainer.output_dir={out}", *common, *spec.rl,
                          *rl_overrides], RECIPES / "demo_grpo.yaml")
    phase("3/4 RL", f"GRPO ({RECIPES / 'demo_grpo.yaml'}); held-out accuracy (val) before the first step and "
                    f"after the last")
    train(rl_cfg)
    lap("rl")
    before, after, curve = _accuracies(out / "metrics.jsonl")
    phase("4/4 report", f"plots and {out / 'report.html'}")
    report = _report(out)
    lap("report")
    summary = {
        "accuracy_before_rl": before, "accuracy_after_rl": after, "gain_points": round(100 * (after - before), 2),
        "minutes": round((time.perf_counter() - start) / 60, 3), "minutes_by_phase": minutes,
        "decoding": _decoding(rl_cfg.rollout.val_temperature), "heldout_problems": spec.n_heldout,
        "validation_curve": curve,
        "report": report, "size": asdict(spec), "sft_overrides": list(sft_overrides),
        "rl_overrides": list(rl_overrides), "seed": seed,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
