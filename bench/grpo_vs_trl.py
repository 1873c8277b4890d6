"""One GRPO configuration run by hybridflow and by TRL's `GRPOTrainer`, side by side in one invocation.

    python bench/grpo_vs_trl.py --device cpu                       # tiny Qwen2, 2 CPU cores
    python bench/grpo_vs_trl.py --device cuda --shape qwen2-0.5b   # the 0.5B shape on one GPU, 151,936 vocab

Both get the same randomly initialised model (Qwen2 architecture, a byte-level BPE tokenizer of 400 tokens;
the model's vocabulary is `--vocab`, by default Qwen2's 151,936 on a GPU so the head costs what a real
model's does, the tokenizer's own on a CPU; sampled ids past the tokenizer decode to nothing), the same
prompts, the same reward function (`bench/grpo_reward.py`), prompts per step, group size, response
length limit, learning rate, loss aggregation (token-mean: TRL's default `dapo` loss), no KL term
(TRL's default `beta=0`), one optimizer step per batch, sampling at temperature 1. TRL uses its default
`transformers.generate` path (no vLLM). Each framework runs in its own subprocess (so peak memory is its
own); seconds per step are the median of the steps after the first `--warmup` ones. Generation tokens
per second: ours from the step's `timing_s/gen`, TRL's from the time inside `model.generate`. Peak
memory: the allocator's peak (RSS on a CPU) and, on a GPU, the device's whole used memory sampled every
50 ms. hybridflow's phases (`timing_s/...`, `other` = the controller's time between them) and, with
`--profile`, a torch-profiler op table of its last step and, per phase, how busy the GPU was (gaps where
it waited on the host) go to the JSON. Prints a table and writes JSON
(`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# before hybridflow, which sets PYTORCH_CUDA_ALLOC_CONF where it is unset: bench_util keeps the user's value
from bench_util import DeviceMemoryWatch, child_env, git_commit, peak_memory_gb, trl_versions, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hybridflow.utils.model_shapes import QWEN_SHAPES, tiny_model_kwargs  # noqa: E402

SHAPES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2),
    "cpu-small": dict(hidden=128, layers=4, heads=4, kv_heads=2),
    "qwen2-0.5b": tiny_model_kwargs(QWEN_SHAPES["0.5b"]),
}


def make_inputs(work: Path, shape: dict, n_prompts: int, seed: int, vocab: int | None = None,
                device: str = "cpu") -> tuple[Path, Path]:
    """A random model of `shape` (`SHAPES` values, Qwen2 unless it names an `arch`; `vocab`: the model's
    vocabulary, None = the tokenizer's)
    and a prompt parquet (synthetic GSM8K-style, verl format). `device="cuda"` makes the weights there in
    bf16 (billion-parameter shapes; call it from a process that exits afterwards, so no CUDA context
    lingers beside the measured runs)."""
    import torch

    from hybridflow.data.gsm8k_synthetic import make_rows, write_parquet
    from hybridflow.utils.tiny_model import build_tiny_model

    rows = make_rows(n_prompts, "train", seed)
    texts = [r["prompt"][0]["content"] for r in rows]
    shape = {"arch": "qwen2", **shape}
    model = build_tiny_model(work / "model", seed=seed, train_texts=texts, vocab_size=400,
                             max_positions=2048, model_vocab_size=vocab, device=device,
                             dtype=torch.bfloat16 if device == "cuda" else torch.float32, **shape)
    return model, write_parquet(rows, work / "train.parquet")


# the training-inference mismatch and router metrics a step reports, kept per step
MISMATCH_METRICS = ("rollout_corr/", "training/rollout", "router/")


def run_hybridflow(a: argparse.Namespace) -> dict:
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import RLTrainer

    out = Path(a.work) / "hf_run"
    cfg = load_config([
        f"model.path={a.work}/model", f"data.train_files={a.work}/train.parquet",
        f"data.train_batch_size={a.prompts}", "data.max_prompt_length=512",
        f"data.max_response_length={a.max_new_tokens}", f"rollout.n={a.n}", "rollout.temperature=1.0",
        f"actor.lr={a.lr}", "actor.mini_batch_size=null", "actor.kl_loss_coef=0", "actor.loss_agg=token-mean",
        "actor.weight_decay=0.0", "actor.grad_clip=1.0", "algorithm.adv_estimator=grpo",
        f"reward.function={HERE / 'grpo_reward.py'}:reward", "reward.num_workers=1",
        f"trainer.total_steps={a.steps}", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out}", "trainer.resume=never", f"trainer.device={a.device}",
        f"trainer.seed={a.seed}", "trainer.save_every=0", *a.set,
    ])
    trainer = RLTrainer(cfg)
    step_s, gen_tok_s, lengths, phases, mfu, tokens_per_s, logp_gap, mismatch = [], [], [], [], [], [], [], []
    profile = None
    try:
        for i in range(a.steps):
            batch = trainer.train_loader.next_batch()
            if a.profile and i == a.steps - 1:
                m, profile = profiled(lambda b=batch: trainer.train_step(b), a.device, trace=a.trace)
            else:
                m = trainer.train_step(batch)
            trainer.step += 1
            step_s.append(m["timing_s/step"])
            tokens = m["response_length/mean"] * a.prompts * a.n
            gen_tok_s.append(tokens / m["timing_s/gen"])
            if "perf/mfu/actor" in m:  # on a GPU: the actor update's model FLOPs utilisation
                mfu.append(m["perf/mfu/actor"])
            lengths.append(m["response_length/mean"])
            tokens_per_s.append(m["perf/throughput"])  # prompt + response tokens of the step per second
            if "rollout_corr/max_abs_logp_diff" in m:  # the training-inference mismatch (0 in exact mode)
                logp_gap.append(m["rollout_corr/max_abs_logp_diff"])
            phase = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("timing_s/")}
            # the controller's own time between phases: dispatch, batch assembly, metrics
            phase["other"] = phase["step"] - sum(v for k, v in phase.items() if k != "step")
            phases.append(phase)
            mismatch.append({k: v for k, v in m.items() if k.startswith(MISMATCH_METRICS)})
            print(f"hybridflow step {trainer.step}: {m['timing_s/step']:.3f}s", flush=True)
    finally:
        trainer.close()
    return {"step_s": step_s, "gen_tokens_per_s": gen_tok_s, "response_length_mean": lengths,
            "phases_s": phases, "mfu_actor": mfu, "tokens_per_s": tokens_per_s, "max_abs_logp_diff": logp_gap,
            "mismatch": mismatch,
            "peak_memory_gb": peak_memory_gb(a.device), "profile": profile}


def profiled(fn, device: str, rows: int = 30, trace: str | None = None):
    """(fn(), {"table": the torch profiler's table of the ops that took the most device time during it,
    "phases": `phase_busy`'s account of each phase on a GPU}); `trace`: also write a gzipped Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
    if trace:
        import gzip
        import shutil

        raw = Path(trace).with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    sort = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    return result, {"table": table, "phases": phase_busy(prof.events())}


def phase_busy(events) -> dict[str, dict[str, float]]:
    """For each `phase/<name>` range of the trainer's step: its wall time, the time at least one GPU
    kernel or copy ran within it (the union of their intervals), their share of the wall time, and the
    longest gaps between them (where the GPU waited on the host)."""
    from torch.autograd import DeviceType

    # the `phase/*` ranges also appear on the GPU timeline (as annotations spanning the phase): not work
    device = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == DeviceType.CUDA and not e.name.startswith("phase/"))
    out = {}
    for ph in (e for e in events if e.name.startswith("phase/") and e.device_type == DeviceType.CPU):
        lo, hi = ph.time_range.start, ph.time_range.end
        busy, gaps, cursor = 0.0, [], lo
        for start, end in device:
            start, end = max(start, lo), min(end, hi)
            if end <= start:
                continue
            if start > cursor:
                gaps.append(start - cursor)
            busy += max(0.0, end - max(start, cursor))
            cursor = max(cursor, end)
        gaps.append(max(0.0, hi - cursor))
        wall = hi - lo
        out[ph.name.split("/", 1)[1]] = {"wall_s": wall / 1e6, "gpu_busy_s": busy / 1e6,
                                         "gpu_busy_fraction": busy / wall if wall else 0.0,
                                         "gaps_over_1ms": sum(g > 1000 for g in gaps),
                                         "gap_s_over_1ms": sum(g for g in gaps if g > 1000) / 1e6,
                                         "longest_gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:8]]}
    return out


def run_trl(a: argparse.Namespace) -> dict:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(HERE))
    from grpo_reward import trl_reward

    df = pd.read_parquet(Path(a.work) / "train.parquet")
    ds = Dataset.from_dict({"prompt": [list(p) for p in df["prompt"]],
                            "ground_truth": [r["ground_truth"] for r in df["reward_model"]]})
    tok = AutoTokenizer.from_pretrained(Path(a.work) / "model")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(Path(a.work) / "model", dtype=dtype)
    times: list[float] = []
    gen_s: list[float] = []  # seconds inside `model.generate` per step (TRL calls it once per step here)
    generate = model.generate

    def timed_generate(*args, **kwargs):
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        sync()
        gen_s[-1] += time.perf_counter() - start
        return out

    model.generate = timed_generate

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            gen_s.append(0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            print(f"trl step {state.global_step}: {times[-1]:.3f}s", flush=True)
            # what a run stopped by --child-budget-s keeps: the steps done so far
            Path(a.result + ".partial").write_text(json.dumps(
                {"step_s": times, "gen_s": gen_s[:len(times)], "response_length_mean": [],
                 "peak_memory_gb": peak_memory_gb(a.device)}))

    rows = a.prompts * a.n
    cfg = GRPOConfig(
        output_dir=str(Path(a.work) / "trl_run"), per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=a.n, max_completion_length=a.max_new_tokens, learning_rate=a.lr, beta=0.0,
        loss_type="dapo", temperature=1.0, max_steps=a.steps, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=a.device == "cpu", bf16=a.device == "cuda", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, seed=a.seed, disable_dropout=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    gen_tok_s = [n * rows / g for n, g in zip(lengths, gen_s) if g > 0]
    return {"step_s": times, "response_length_mean": lengths, "gen_s": gen_s,
            "gen_tokens_per_s": gen_tok_s if len(gen_tok_s) == len(times) else None,
            "peak_memory_gb": peak_memory_gb(a.device)}


def child(a: argparse.Namespace) -> None:
    watch = DeviceMemoryWatch() if a.device == "cuda" else None
    result = (run_hybridflow if a.child == "hybridflow" else run_trl)(a)
    if watch is not None:
        result["peak_device_memory_gb"] = watch.stop()
    Path(a.result).write_text(json.dumps(result))


def summarize(name: str, r: dict, warmup: int) -> dict:
    steady = r["step_s"][warmup:] or r["step_s"]
    out = {"framework": name, "step_s_median": statistics.median(steady), "step_s_all": r["step_s"],
           "first_step_s": r["step_s"][0], "peak_memory_gb": r["peak_memory_gb"],
           "peak_device_memory_gb": r.get("peak_device_memory_gb"),
           "response_length_mean": statistics.mean(r["response_length_mean"]) if r["response_length_mean"] else None}
    if r.get("phases_s"):
        kept = r["phases_s"][warmup:] or r["phases_s"]
        out["phases_s_median"] = {k: statistics.median(p[k] for p in kept if k in p) for k in kept[-1]}
        out["phases_s_all"] = r["phases_s"]
        out["response_length_all"] = r["response_length_mean"]
    if r.get("profile"):
        out["profile_last_step"] = r["profile"]
    if r.get("gen_s"):
        out["gen_s_median"] = statistics.median(r["gen_s"][warmup:] or r["gen_s"])
    for key in ("gen_tokens_per_s", "mfu_actor", "tokens_per_s"):
        if r.get(key):
            out[f"{key}_median"] = statistics.median(r[key][warmup:] or r[key])
    if r.get("max_abs_logp_diff"):
        out["max_abs_logp_diff_max"] = max(r["max_abs_logp_diff"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: tiny on cpu, qwen2-0.5b on cuda")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8 cpu / 32 cuda)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--vocab", type=int, default=None,
                   help="the model's vocabulary (default 151,936 on cuda, the 400-token tokenizer's on cpu)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32 cpu / 256 cuda")
    p.add_argument("--steps", type=int, default=None, help="default 20 cpu / 10 cuda")
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps left out of the median (default 4 cpu / 2 cuda: on a CPU the allocator "
                        "takes a few steps to settle)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("hybridflow", "trl"), default=None)
    p.add_argument("--child-budget-s", type=float, default=None,
                   help="stop each framework's run after this many seconds and report the steps it finished "
                        "(TRL's steps, which it records one by one; e.g. TRL at 4,096-token responses, whose "
                        "steps take minutes)")
    p.add_argument("--profile", action="store_true",
                   help="run hybridflow's last step under the torch profiler; its op table goes to the JSON")
    p.add_argument("--trace", default=None, metavar="PATH.json.gz",
                   help="with --profile: also write the profiled step's Chrome trace there, gzipped")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra hybridflow config override (repeatable), e.g. rollout.cuda_graphs=false")
    p.add_argument("--against", default=None, metavar="JSON",
                   help="an earlier run's JSON (e.g. the default's, beside this run's --set rollout.exact=true): "
                        "the report adds this run's hybridflow step time over that one's")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/grpo_vs_trl_<device>.json)")
    p.add_argument("--child", choices=("hybridflow", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    cpu = a.device == "cpu"
    a.shape = a.shape or ("tiny" if cpu else "qwen2-0.5b")
    a.prompts = a.prompts or (8 if cpu else 32)
    a.max_new_tokens = a.max_new_tokens or (32 if cpu else 256)
    a.steps = a.steps or (20 if cpu else 10)
    a.warmup = a.warmup if a.warmup is not None else (4 if cpu else 2)
    a.vocab = a.vocab or (None if cpu else 151936)
    if a.child:
        return child(a)
    work = Path(tempfile.mkdtemp(prefix="grpo_vs_trl_"))
    make_inputs(work, SHAPES[a.shape], max(64, a.prompts * (a.steps + 1)), a.seed, a.vocab)
    results = {}
    for name in ("hybridflow", "trl"):
        if a.only and name != a.only:
            continue
        res = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--result", str(res)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k in ("device", "shape", "prompts", "n", "max_new_tokens", "steps", "lr", "seed")]
        cmd += ["--profile"] if a.profile else []
        cmd += [f"--trace={Path(a.trace).resolve()}"] if a.trace else []
        cmd += [f"--set={kv}" for kv in a.set]
        start = time.perf_counter()
        stopped = False
        try:
            proc = subprocess.run(cmd, env=child_env(name), stderr=subprocess.PIPE, text=True,
                                  timeout=a.child_budget_s)
            returncode, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            stopped, returncode = True, None
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        sys.stderr.write(stderr[-20000:])
        if stopped or returncode:  # the steps it finished, if any, beside why it ended (e.g. out of memory)
            res = Path(str(res) + ".partial")
        results[name] = summarize(name, json.loads(res.read_text()), a.warmup) if res.exists() else {"framework": name}
        if stopped:
            results[name]["stopped_after_s"] = a.child_budget_s
        if returncode or "step_s_median" not in results[name]:
            results[name].update(error=f"stopped after {a.child_budget_s} s" if stopped else f"exit code {returncode}",
                                 stderr_tail=stderr[-4000:])
        results[name]["wall_s"] = time.perf_counter() - start
        results[name]["cuda_alloc_conf"] = child_env(name)["PYTORCH_CUDA_ALLOC_CONF"]
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "cpus": os.cpu_count(), "torch": torch.__version__, "settings": {k: v for k, v in vars(a).items()
              if k in ("device", "shape", "prompts", "n", "max_new_tokens", "steps", "warmup", "lr", "seed", "set",
                       "vocab")},
              "commit": git_commit(),
              "results": results}
    if all("step_s_median" in results.get(name, {}) for name in ("hybridflow", "trl")):
        report["speedup_step"] = results["trl"]["step_s_median"] / results["hybridflow"]["step_s_median"]
    report.update(trl_versions())
    print(f"\n{'framework':<12}{'s/step (median)':>17}{'first step s':>14}{'gen tok/s':>11}{'peak GiB':>10}"
          f"{'device GiB':>12}{'resp len':>10}")
    for r in results.values():
        if "error" in r:
            print(f"{r['framework']:<12} failed: {r['error']} (stderr tail in the JSON)"
                  + (f", after {len(r['step_s_all'])} finished steps:" if "step_s_all" in r else ""))
        if "step_s_median" not in r:
            continue
        print(f"{r['framework']:<12}{r['step_s_median']:>17.3f}{r['first_step_s']:>14.2f}"
              f"{r.get('gen_tokens_per_s_median') or 0:>11,.0f}{r['peak_memory_gb']:>10.2f}"
              f"{r['peak_device_memory_gb'] or 0:>12.2f}{r['response_length_mean'] or 0:>10.1f}")
    if "phases_s_median" in results.get("hybridflow", {}):
        print("hybridflow phases (s):", {k: round(v, 3) for k, v in results["hybridflow"]["phases_s_median"].items()})
    if "profile_last_step" in results.get("hybridflow", {}):
        prof = results["hybridflow"]["profile_last_step"]
        print(prof["table"])
        for name, ph in prof["phases"].items():
            print(f"phase {name}: {ph['wall_s']:.3f} s, GPU busy {ph['gpu_busy_fraction']:.0%}, "
                  f"{ph['gaps_over_1ms']} gaps > 1 ms totalling {ph['gap_s_over_1ms']:.3f} s")
    if "mfu_actor_median" in results.get("hybridflow", {}):
        print(f"hybridflow actor update MFU: {results['hybridflow']['mfu_actor_median']:.1%}")
    if "speedup_step" in report:
        print(f"hybridflow speed-up per step: {report['speedup_step']:.2f}x")
    if a.against and "step_s_median" in results.get("hybridflow", {}):
        other = json.loads(Path(a.against).read_text())
        base = other["results"]["hybridflow"]
        report["against"] = {"path": a.against, "set": other["settings"].get("set"),
                             "step_s_median": base["step_s_median"], "phases_s_median": base.get("phases_s_median"),
                             "step_ratio": results["hybridflow"]["step_s_median"] / base["step_s_median"]}
        print(f"hybridflow step against {a.against} (--set {other['settings'].get('set')}): "
              f"{report['against']['step_ratio']:.3f}x")
    write_json(report, a.out or HERE / "results" / f"grpo_vs_trl_{a.device}.json")


if __name__ == "__main__":
    main()
