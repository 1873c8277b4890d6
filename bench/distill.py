"""On-policy distillation on a real model: a GRPO-trained SmolLM2-135M-Instruct teaches the untrained one.

    python bench/distill.py --device cpu                                      # toy scale on 2 CPU cores
    python bench/distill.py --device cuda --model PATH                        # one GPU

Two phases, each its own subprocess, on the GSM8K-style data and settings of the learning race
(`bench/learn_vs_trl.py`: `recipes/gsm8k_smollm2.yaml`, the same prompts per step, group size, response limit,
learning rate, and the same instrument: greedy accuracy on held-out prompts by our rollout engine, the clock
paused while it measures):
1. `grpo`: the race's GRPO run for `--grpo-budget-s` seconds of training; its final policy is saved as the
   teacher (exported from a checkpoint, in `<work>/teacher`).
2. `distill`: the untrained model (the same starting weights) distilled from that teacher for
   `--distill-budget-s` seconds: `teacher.model.path=<teacher>`, the per-token reverse KL alone as the
   advantage (`teacher.task_reward=false`; `--distill-set` adds overrides, e.g. `actor.lr=1e-5`). With
   `--distill-sweep KEY=V1,V2,...` this phase runs once per value from the same teacher (the JSON's `summary`
   then holds one entry per run, keyed `distill KEY=V`).

The target (issue 41): the student reaches >= 90 % of the teacher's greedy accuracy (its accuracy at the end of
the GRPO phase) in <= 1/3 of the training time GRPO took to reach that same accuracy. The summary gives both
times and their ratio. Writes JSON (`--out`, each phase's accuracy curve, steps' metrics and device peak) and a
PNG of accuracy against training wall-clock next to it; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_util import DeviceMemoryWatch, git_commit, write_json  # noqa: E402
from learn_vs_trl import (RACE_DEFAULTS, add_race_arguments, device_defaults, plot,  # noqa: E402
                          race_hybridflow, race_inputs, time_to)

TARGET_SHARE = 0.9  # of the teacher's accuracy
TIME_LIMIT = 1 / 3  # of GRPO's time to that accuracy


def save_teacher(out: Path):
    """`finish` for the GRPO phase: a checkpoint of the final policy, exported as a Hugging Face directory."""
    def finish(trainer) -> None:
        from hybridflow.checkpoint import export_hf

        export_hf(trainer.checkpoints.save(), out, role="actor")
        print(f"teacher saved to {out}", flush=True)

    return finish


def child(a: argparse.Namespace) -> None:
    watch = None if a.device == "cpu" else DeviceMemoryWatch()
    teacher = Path(a.work) / "teacher"
    if a.child == "grpo":
        a.budget_s, a.eval_every_s = a.grpo_budget_s, a.grpo_eval_every_s
        result = race_hybridflow(a, a.set, name="grpo", finish=save_teacher(teacher))
    else:
        a.budget_s, a.eval_every_s = a.distill_budget_s, a.distill_eval_every_s
        overrides = [f"teacher.model.path={teacher}", "teacher.task_reward=false", "actor.kl_loss_coef=0", *a.set,
                     *a.distill_set]
        result = race_hybridflow(a, overrides, name="distill")
    if watch is not None:
        import torch

        result["peak_device_memory_gb"] = watch.stop()
        result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    Path(a.result).write_text(json.dumps(result))


def summarize(results: dict, distill: str = "distill") -> dict:
    """The teacher's accuracy, the target, when GRPO and the distillation run `distill` first reached it, and
    the ratio of those times."""
    for r in results.values():
        r["final_accuracy"], r["steps_done"] = r["points"][-1]["accuracy"], r["points"][-1]["step"]
    teacher = results["grpo"]["final_accuracy"]
    target = TARGET_SHARE * teacher
    # a phase whose starting point already meets the target reached it at 0 s; GRPO at 0 s leaves no ratio
    grpo_s, distill_s = (None if (t := time_to(results[name]["points"], target)) is None
                         else 0.0 if t == results[name]["points"][0]["train_s"] else t
                         for name in ("grpo", distill))
    fraction = None if grpo_s is None or distill_s is None or grpo_s == 0 else distill_s / grpo_s
    return {"teacher_accuracy": teacher, "student_start_accuracy": results[distill]["points"][0]["accuracy"],
            "target_accuracy": target, "grpo_train_s_to_target": grpo_s, "distill_train_s_to_target": distill_s,
            "time_fraction": fraction, "target_met": fraction is not None and fraction <= TIME_LIMIT}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_race_arguments(p)
    p.add_argument("--grpo-budget-s", type=float, default=None, help="GRPO training seconds (default 150 cuda / "
                                                                    "20 cpu)")
    p.add_argument("--grpo-eval-every-s", type=float, default=None, help="default 10 cuda / 10 cpu")
    p.add_argument("--distill-budget-s", type=float, default=None, help="distillation training seconds (default "
                                                                       "60 cuda / 20 cpu)")
    p.add_argument("--distill-eval-every-s", type=float, default=None, help="default 4 cuda / 10 cpu: finer than "
                                                                           "GRPO's, a third of its time is short")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="hybridflow override for both phases (repeatable)")
    p.add_argument("--distill-set", action="append", default=[], metavar="KEY=VALUE",
                   help="hybridflow override for the distillation phase only (repeatable), e.g. actor.lr=1e-5")
    p.add_argument("--distill-sweep", default=None, metavar="KEY=V1,V2,...",
                   help="one distillation run per value of KEY, from the same teacher (e.g. actor.lr=5e-6,2e-5,5e-5)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/distill_<device>.json)")
    p.add_argument("--child", choices=("grpo", "distill"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    device_defaults(a, {**RACE_DEFAULTS, "grpo_budget_s": (150.0, 20.0), "grpo_eval_every_s": (10.0, 10.0),
                        "distill_budget_s": (60.0, 20.0), "distill_eval_every_s": (4.0, 10.0)})
    if a.child:
        return child(a)
    model_dir, work = race_inputs(a, "distill_")
    settings = ("device", "prompts", "n", "max_new_tokens", "max_prompt_length", "lr", "weight_decay",
                "grpo_budget_s", "grpo_eval_every_s", "distill_budget_s", "distill_eval_every_s", "n_train", "n_val",
                "seed")
    if a.distill_sweep:
        key, _, values = a.distill_sweep.partition("=")
        runs = {f"distill {key}={v}": [f"{key}={v}"] for v in values.split(",")}
    else:
        runs = {"distill": []}
    results = {}
    for name, extra in [("grpo", []), *runs.items()]:
        phase = name.split()[0]
        budget = a.grpo_budget_s if phase == "grpo" else a.distill_budget_s
        print(f"{name}: {budget:.0f}s of training", flush=True)
        res = work / f"{len(results)}.json"
        cmd = [sys.executable, __file__, "--child", phase, "--work", str(work), "--model-dir", str(model_dir),
               "--result", str(res)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in settings]
        cmd += [f"--set={kv}" for kv in a.set] + [f"--distill-set={kv}" for kv in [*a.distill_set, *extra]]
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        results[name] = json.loads(res.read_text())
    summaries = {name: summarize(results, name) for name in runs}
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "cpus": os.cpu_count(), "torch": torch.__version__, "model": str(model_dir), "commit": git_commit(),
              "settings": {**{k: v for k, v in vars(a).items() if k in settings}, "set": a.set,
                           "distill_set": a.distill_set, "distill_sweep": a.distill_sweep},
              "summary": summaries["distill"] if "distill" in summaries else summaries, "results": results}
    width = max(len(name) for name in results) + 2
    print(f"\n{'phase':<{width}}{'setup s':>9}{'steps':>7}{'start acc':>11}{'final acc':>11}{'device peak GiB':>17}")
    for name, r in results.items():
        peak = r.get("peak_device_memory_gb")
        print(f"{name:<{width}}{r['setup_s']:>9.1f}{r['steps_done']:>7}{r['points'][0]['accuracy']:>11.1%}"
              f"{r['final_accuracy']:>11.1%}{'-' if peak is None else f'{peak:.2f}':>17}")

    def when(seconds: float | None) -> str:
        return "never" if seconds is None else f"after {seconds:.0f} s"

    for name, s in summaries.items():
        print(f"teacher {s['teacher_accuracy']:.1%}; target {s['target_accuracy']:.1%}: GRPO reached it "
              f"{when(s['grpo_train_s_to_target'])}, {name} {when(s['distill_train_s_to_target'])}"
              + ("" if s["time_fraction"] is None else f" ({s['time_fraction']:.2f} of GRPO's time; "
                 f"target <= {TIME_LIMIT:.2f}: {'met' if s['target_met'] else 'not met'})"))
    out = Path(a.out or HERE / "results" / f"distill_{a.device}.json")
    write_json(report, out)
    plot(results, out.with_suffix(".png"), f"GRPO teacher -> on-policy distillation, SmolLM2-135M-Instruct, "
                                           f"{a.prompts}x{a.n}, {report['device']}")
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
