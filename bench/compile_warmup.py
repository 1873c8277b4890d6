"""The first steps of a compiled update with and without the background compile warm-up (`model.compile_warmup`).

    python bench/compile_warmup.py --device cpu --model tiny                 # toy size on 2 CPU cores
    python bench/compile_warmup.py --device cpu --model PATH                 # e.g. SmolLM2-135M (fp32)
    python bench/compile_warmup.py --device cuda --model PATH                # on a GPU (bf16 over fp32)
    python bench/compile_warmup.py --device cuda --model smollm2 --mode cold --checkpointing --rows 64 \
        --prompt 100 --response 200     # the race's model shape, random weights: the first step's stall
    python bench/compile_warmup.py --device cuda --model smollm2 --mode eager --checkpointing --rows 512 \
        --prompt 100 --response 190 --after 3   # what a race-sized step costs uncompiled

Each mode runs in its own process with an empty inductor cache: `cold` compiles at first use (the warm-up
off), `warmup` trains eagerly while the warm-up subprocess compiles, then switches; `eager` (run on its
own, not part of the default `both`) never compiles. A step is one no-grad log-prob pass with entropy plus
one optimizer step (forward + backward with an entropy term) on `--rows` random rows; steps run until
`--after` steps have run compiled (eager: `--after` steps) or `--max-s` seconds have passed. Prints and
writes (`--out`, default bench/results/compile_warmup_<device>.json) each step's seconds and whether it ran
compiled, the warm-up's duration, and on a GPU the allocator's peak and the device's (the whole GPU's used
memory, the warm-up subprocess's included: `grpo_vs_trl.DeviceMemoryWatch`). Each mode's JSON also holds
where its compilation went (`compile_s`: dynamo's timed phases summed over the graphs), dynamo's graph
counts and recompiles. On a GPU the engine runs in a one-rank process group (FSDP2 mixed precision), as in
a training run. `--model smollm2` is SmolLM2-135M's shape (30 layers) with random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from grpo_vs_trl import DeviceMemoryWatch, git_commit, write_json  # noqa: E402


def run_mode(args: argparse.Namespace) -> dict:
    from types import SimpleNamespace

    import torch

    from hybridflow.engine.train import TrainEngine
    from hybridflow.engine.train.warmup import random_batch

    device = torch.device(args.device)
    watch = DeviceMemoryWatch() if device.type == "cuda" else None
    if device.type == "cuda":  # a one-rank group, as a training run has: FSDP2's bf16 over fp32 master weights
        import torch.distributed as dist

        torch.cuda.set_device(device.index or 0)  # a bare "cuda" has no index, which set_device needs
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    path = args.model
    if path == "tiny":
        from hybridflow.utils.tiny_model import build_tiny_model

        path = str(build_tiny_model(tempfile.mkdtemp(prefix="tiny-"), layers=4))
    elif path == "smollm2":
        from transformers import LlamaConfig, LlamaForCausalLM

        from hybridflow.utils.model_shapes import SMOLLM2_135M

        path = tempfile.mkdtemp(prefix="smollm2-shape-")
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(path)
    cfg = SimpleNamespace(path=path, dtype="auto", compile=args.mode != "eager", compile_warmup=args.mode == "warmup",
                          gradient_checkpointing=args.checkpointing)
    optim = SimpleNamespace(lr=1e-5, lr_schedule="constant", lr_warmup_steps=0, min_lr_ratio=0.0,
                            weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0)
    engine = TrainEngine(cfg, optim, device=device)
    batch = random_batch(engine.config.vocab_size, args.rows, args.prompt, args.response)

    def loss_fn(out, mb, ctx):
        mask = mb["response_mask"]
        return ((out["log_probs"] - 0.01 * out["entropy"]) * mask).sum() / ctx.global_tokens, {}

    steps, start = [], time.perf_counter()
    counted = (lambda: len(steps)) if args.mode == "eager" else (lambda: sum(s["compiled"] for s in steps))
    while counted() < args.after and time.perf_counter() - start < args.max_s:
        t = time.perf_counter()
        engine.infer(batch, with_entropy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        infer_s = time.perf_counter() - t
        engine.train_step(batch, loss_fn, with_entropy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append({"seconds": round(time.perf_counter() - t, 3), "infer_s": round(infer_s, 3),
                      "compiled": engine.compiled})
    from torch._dynamo.utils import compile_times, counters

    phases, seconds = compile_times(repr="csv", aggregate=True)
    out = {"mode": args.mode, "steps": steps, "until_compiled_s": round(time.perf_counter() - start, 2),
           "warmup_s": engine.warmup_seconds,
           # where this process's compilation went (dynamo's timed phases, summed over its graphs) and how many
           # graphs it compiled: the first step's stall, by phase
           "compile_s": {phase: round(float(value), 2) for phase, value in zip(phases, seconds)},
           "dynamo_stats": dict(counters["stats"]), "recompiles": dict(counters["recompiles"])}
    if watch is not None:
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_device_memory_gb"] = watch.stop()
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="tiny", help="a Hugging Face model directory, tiny or smollm2")
    parser.add_argument("--mode", default="both", choices=("both", "cold", "warmup", "eager"),
                        help="eager: no compilation, --after steps (what a step costs before the compile lands)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--response", type=int, default=40)
    parser.add_argument("--after", type=int, default=2, help="compiled steps (eager: steps) to run before stopping")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (the default under 1B)")
    parser.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mode != "both":
        result = run_mode(args)
        print("RESULT " + json.dumps(result), flush=True)
        if args.out:  # a child of `both` has none: its parent writes
            write_json({"args": vars(args), "commit": git_commit(), "runs": [result]}, args.out)
        return
    results = []
    for mode in ("cold", "warmup"):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("mode", "out")]
            proc = subprocess.run([sys.executable, __file__, *argv, f"--mode={mode}"], capture_output=True, text=True,
                                  env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache))
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
            steps = results[-1]["steps"]
            first = next(i for i, s in enumerate(steps + [{"compiled": True}]) if s["compiled"])
            print(f"{mode}: {first} eager steps ({sum(s['seconds'] for s in steps[:first]):.1f} s), first compiled "
                  f"step {steps[first]['seconds'] if first < len(steps) else float('nan'):.1f} s, later "
                  f"{steps[-1]['seconds']:.2f} s; warm-up {results[-1]['warmup_s'] or 0:.1f} s", flush=True)
    write_json({"args": vars(args), "commit": git_commit(), "runs": results},
               args.out or HERE / "results" / f"compile_warmup_{args.device}.json")


if __name__ == "__main__":
    main()
