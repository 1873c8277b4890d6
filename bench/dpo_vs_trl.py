"""One DPO configuration run by hybridflow (`hybridflow dpo`) and by TRL's `DPOTrainer`, side by side.

    python bench/dpo_vs_trl.py --device cpu                      # tiny Qwen2, 2 CPU cores: does it run
    python bench/dpo_vs_trl.py --device cuda                     # the 0.5B shape, 151,936 vocabulary

Both get the same randomly initialised model (Qwen2 architecture; the model's vocabulary is `--vocab`, by
default Qwen2's 151,936 on a GPU so the LM head costs what a real model's does) and the same pairs in TRL's
plain format: a prompt of `--prompt-len` random letters and two completions of `--completion-len`, which the
byte-level tokenizer (no merges) makes exactly that many tokens, plus the eos token both frameworks append to
a plain completion. Same pairs per step (`--pairs`: one optimizer step per batch), DPO's sigmoid loss at
beta 0.1, learning rate, AdamW without weight decay, gradient clipping at 1.0, bf16 on a GPU. Each framework
keeps its own defaults otherwise (ours: the device plan's micro-batches, packing and recomputation; TRL's:
`gradient_checkpointing=True`, the whole batch in one forward, its fused LM head). The reference's log-probs:
ours are computed once before training by the starting model; TRL's per `--trl-ref`: `precompute`
(`precompute_ref_log_probs=True`: the same work per step as ours) and/or `per-step` (TRL's default: a reference
copy of the model scores each batch in the step). Each run is its own subprocess (its peak memory its own);
seconds per step are the median after the first `--warmup` steps; the reference pass is timed apart. Peak
memory: the allocator's peak (RSS on a CPU) and the device's used memory sampled every 50 ms. Prints a table
and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_util import DeviceMemoryWatch, child_env, git_commit, peak_memory_gb, trl_versions, write_json  # noqa: E402
from grpo_vs_trl import SHAPES  # noqa: E402

TRL_REF_MODES = ("precompute", "per-step")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_inputs(work: Path, shape: dict, pairs: int, prompt_len: int, completion_len: int, seed: int,
                vocab: int | None) -> None:
    """The random model (a byte-level tokenizer without merges: one token per letter) and `pairs` plain pairs."""
    from hybridflow.utils.tiny_model import build_tiny_model

    build_tiny_model(work / "model", arch="qwen2", seed=seed, max_positions=max(2048, prompt_len + completion_len + 8),
                     model_vocab_size=vocab, **shape)
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(n))

    rows = [{"prompt": text(prompt_len), "chosen": text(completion_len), "rejected": text(completion_len)}
            for _ in range(pairs)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_hybridflow(a: argparse.Namespace) -> dict:
    from hybridflow.config.loader import load_config
    from hybridflow.config.preference_schema import DPOConfig
    from hybridflow.trainer.preference_trainer import DPOTrainer

    out = Path(a.work) / "hf_run"
    cfg = load_config([
        f"model.path={a.work}/model", f"data.train_files={a.work}/pairs.jsonl", f"data.train_batch_size={a.pairs}",
        "data.apply_chat_template=false", f"data.max_length={a.prompt_len + a.completion_len + 1}",
        "data.shuffle=false", f"optim.lr={a.lr}", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
        "dpo.loss_type=sigmoid", "dpo.beta=0.1", f"trainer.total_steps={a.steps}", "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out}", "trainer.resume=never", f"trainer.device={a.device}", f"trainer.seed={a.seed}",
        *a.set], schema=DPOConfig)
    start = time.perf_counter()
    trainer = DPOTrainer(cfg)  # computes the reference log-probs of every pair
    setup_s = time.perf_counter() - start
    step_s, tokens_per_s = [], []
    try:
        reference_s = next(json.loads(line)["timing_s/reference"] for line in (out / "metrics.jsonl").open()
                           if "timing_s/reference" in line)
        for _ in range(a.steps):
            m = trainer.train_step(trainer.train_loader.next_batch())
            trainer.step += 1
            step_s.append(m["timing_s/step"])
            tokens_per_s.append(m["perf/throughput"])
            print(f"hybridflow step {trainer.step}: {m['timing_s/step']:.3f}s", flush=True)
    finally:
        trainer.close()
    return {"step_s": step_s, "tokens_per_s": tokens_per_s, "reference_s": reference_s, "setup_s": setup_s,
            "peak_memory_gb": peak_memory_gb(a.device)}


def run_trl(a: argparse.Namespace, precompute: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in (Path(a.work) / "pairs.jsonl").read_text().splitlines()]
    ds = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(Path(a.work) / "model")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(Path(a.work) / "model", dtype=dtype)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            print(f"trl step {state.global_step}: {times[-1]:.3f}s", flush=True)

    cfg = DPOConfig(
        output_dir=str(Path(a.work) / "trl_run"), per_device_train_batch_size=a.pairs, gradient_accumulation_steps=1,
        learning_rate=a.lr, beta=0.1, loss_type=["sigmoid"], max_length=a.prompt_len + a.completion_len + 1,
        precompute_ref_log_probs=precompute, precompute_ref_batch_size=a.pairs, max_steps=a.steps, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=a.device == "cpu", bf16=a.device == "cuda",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, seed=a.seed, dataloader_num_workers=0)
    start = time.perf_counter()
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    setup_s = time.perf_counter() - start
    train_start = time.perf_counter()
    trainer.train()
    # with precompute_ref_log_probs, TRL scores the dataset when training starts: the time before the steps
    reference_s = (time.perf_counter() - train_start - sum(times)) if precompute else None
    return {"step_s": times, "reference_s": reference_s, "setup_s": setup_s, "peak_memory_gb": peak_memory_gb(a.device)}


def child(a: argparse.Namespace) -> None:
    watch = DeviceMemoryWatch() if a.device == "cuda" else None
    if a.child == "hybridflow":
        result = run_hybridflow(a)
    else:
        result = run_trl(a, precompute=a.child == "trl-precompute")
    if watch is not None:
        result["peak_device_memory_gb"] = watch.stop()
    Path(a.result).write_text(json.dumps(result))


def summarize(name: str, r: dict, warmup: int, pair_tokens: int) -> dict:
    steady = r["step_s"][warmup:] or r["step_s"]
    median = statistics.median(steady)
    return {"framework": name, "step_s_median": median, "step_s_all": r["step_s"], "first_step_s": r["step_s"][0],
            "pairs_per_s": pair_tokens[0] / median, "tokens_per_s": pair_tokens[1] / median,
            "reference_s": r.get("reference_s"), "setup_s": r.get("setup_s"), "peak_memory_gb": r["peak_memory_gb"],
            "peak_device_memory_gb": r.get("peak_device_memory_gb")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: tiny on cpu, qwen2-0.5b on cuda")
    p.add_argument("--pairs", type=int, default=None, help="pairs per step (default 4 cpu / 32 cuda)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 16 cpu / 256 cuda)")
    p.add_argument("--completion-len", type=int, default=None,
                   help="tokens of each completion before its eos (default 16 cpu / 255 cuda)")
    p.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (default 151,936 on cuda, the "
                                                          "tokenizer's on cpu)")
    p.add_argument("--steps", type=int, default=None, help="default 6 cpu / 10 cuda")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-ref", default="precompute", help=f"TRL's reference mode(s), comma-separated: "
                                                           f"{', '.join(TRL_REF_MODES)}")
    p.add_argument("--only", choices=("hybridflow", "trl"), default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra hybridflow config override (repeatable), e.g. optim.max_tokens_per_micro_batch=16384")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/dpo_vs_trl_<device>.json)")
    p.add_argument("--child", choices=("hybridflow", "trl-precompute", "trl-per-step"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    cpu = a.device == "cpu"
    a.shape = a.shape or ("tiny" if cpu else "qwen2-0.5b")
    a.pairs = a.pairs or (4 if cpu else 32)
    a.prompt_len = a.prompt_len or (16 if cpu else 256)
    a.completion_len = a.completion_len or (16 if cpu else 255)
    a.steps = a.steps or (6 if cpu else 10)
    a.vocab = a.vocab or (None if cpu else 151936)
    modes = [m.strip() for m in a.trl_ref.split(",") if m.strip()]
    if not modes or set(modes) - set(TRL_REF_MODES):
        p.error(f"--trl-ref={a.trl_ref!r}; valid: a comma-separated list of {', '.join(TRL_REF_MODES)}")
    if a.child:
        return child(a)
    work = Path(tempfile.mkdtemp(prefix="dpo_vs_trl_"))
    make_inputs(work, SHAPES[a.shape], a.pairs * a.steps, a.prompt_len, a.completion_len, a.seed, a.vocab)
    # per step: the pairs, and the tokens of both sequences of each (prompt + completion + eos)
    per_step = (a.pairs, a.pairs * 2 * (a.prompt_len + a.completion_len + 1))
    children = [] if a.only == "trl" else ["hybridflow"]
    children += [] if a.only == "hybridflow" else [f"trl-{m}" for m in modes]
    results = {}
    for name in children:
        res = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--result", str(res)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k in ("device", "shape", "pairs", "prompt_len", "completion_len", "steps", "lr", "seed")]
        cmd += [f"--set={kv}" for kv in a.set]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=child_env("trl" if name.startswith("trl") else name), stderr=subprocess.PIPE,
                              text=True)
        sys.stderr.write(proc.stderr[-20000:])
        if proc.returncode or not res.exists():  # recorded (e.g. out of memory)
            results[name] = {"framework": name, "error": f"exit code {proc.returncode}",
                             "stderr_tail": proc.stderr[-4000:]}
        else:
            results[name] = summarize(name, json.loads(res.read_text()), a.warmup, per_step)
        results[name]["wall_s"] = time.perf_counter() - start
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "cpus": os.cpu_count(), "torch": torch.__version__, "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items() if k in ("device", "shape", "pairs", "prompt_len",
                                                                      "completion_len", "steps", "warmup", "lr",
                                                                      "seed", "set", "vocab", "trl_ref")},
              "results": results}
    ours = results.get("hybridflow", {})
    for name, r in results.items():
        if name != "hybridflow" and "step_s_median" in r and "step_s_median" in ours:
            report[f"speedup_vs_{name}"] = r["step_s_median"] / ours["step_s_median"]
    report.update(trl_versions())
    print(f"\n{'framework':<18}{'s/step (median)':>17}{'pairs/s':>10}{'reference s':>13}{'peak GiB':>10}"
          f"{'device GiB':>12}")
    for r in results.values():
        if "error" in r:
            print(f"{r['framework']:<18} failed: {r['error']} (stderr tail in the JSON)")
            continue
        print(f"{r['framework']:<18}{r['step_s_median']:>17.3f}{r['pairs_per_s']:>10.1f}"
              f"{r['reference_s'] if r['reference_s'] is not None else float('nan'):>13.2f}"
              f"{r['peak_memory_gb']:>10.2f}{r['peak_device_memory_gb'] or 0:>12.2f}")
    for key, value in report.items():
        if key.startswith("speedup_vs_"):
            print(f"hybridflow speed-up per step vs {key[len('speedup_vs_'):]}: {value:.2f}x")
    write_json(report, a.out or HERE / "results" / f"dpo_vs_trl_{a.device}.json")


if __name__ == "__main__":
    main()
