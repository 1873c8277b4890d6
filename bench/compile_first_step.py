"""The first steps of a compiled update from empty compile caches, and what a step costs uncompiled.

    python bench/compile_first_step.py --device cpu --model tiny                 # toy size on 2 CPU cores
    python bench/compile_first_step.py --device cuda --model smollm2 --mode cold --checkpointing --rows 64 \
        --prompt 100 --response 200     # the race's model shape, random weights: the first step's stall
    python bench/compile_first_step.py --device cuda --model smollm2 --mode eager --checkpointing --rows 512 \
        --prompt 100 --response 190 --after 3   # what a race-sized step costs uncompiled

`cold` compiles at first use (run it with empty `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR`, as
`bash bench/h200.sh compile_first_step` does); `eager` never compiles. A step is one no-grad log-prob pass
with entropy plus one optimizer step (forward + backward with an entropy term) on `--rows` random rows;
`--after` steps run, or steps until `--max-s` seconds have passed. Prints and writes (`--out`, default
bench/results/compile_first_step_<device>.json) each step's seconds, where the compilation went
(`compile_s`: dynamo's timed phases summed over the graphs), dynamo's graph counts and recompiles, and on a
GPU the allocator's peak and the device's (`bench_util.DeviceMemoryWatch`). On a GPU the engine runs in a
one-rank process group (FSDP2 mixed precision), as in a training run. `--model smollm2` is SmolLM2-135M's
shape (30 layers) with random weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_util import DeviceMemoryWatch, git_commit, write_json  # noqa: E402


def run_mode(args: argparse.Namespace) -> dict:
    import torch

    from hybridflow.config.model_schema import ModelConfig, OptimConfig
    from hybridflow.engine.train import TrainEngine

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
    cfg = ModelConfig(path=path, compile=args.mode == "cold", gradient_checkpointing=args.checkpointing)
    optim = OptimConfig(lr=1e-5, weight_decay=0.0)
    engine = TrainEngine(cfg, optim, device=device)
    batch = random_batch(engine.config.vocab_size, args.rows, args.prompt, args.response)

    def loss_fn(out, mb, ctx):
        mask = mb["response_mask"]
        return ((out["log_probs"] - 0.01 * out["entropy"]) * mask).sum() / ctx.global_tokens, {}

    steps, start = [], time.perf_counter()
    while len(steps) < args.after and time.perf_counter() - start < args.max_s:
        t = time.perf_counter()
        engine.infer(batch, with_entropy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        infer_s = time.perf_counter() - t
        engine.train_step(batch, loss_fn, with_entropy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append({"seconds": round(time.perf_counter() - t, 3), "infer_s": round(infer_s, 3)})
    from torch._dynamo.utils import compile_times, counters

    phases, seconds = compile_times(repr="csv", aggregate=True)
    out = {"mode": args.mode, "steps": steps, "total_s": round(time.perf_counter() - start, 2),
           # where this process's compilation went (dynamo's timed phases, summed over its graphs) and how many
           # graphs it compiled: the first step's stall, by phase
           "compile_s": {phase: round(float(value), 2) for phase, value in zip(phases, seconds)},
           "dynamo_stats": dict(counters["stats"]), "recompiles": dict(counters["recompiles"])}
    if watch is not None:
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_device_memory_gb"] = watch.stop()
    return out


def random_batch(vocab: int, rows: int, prompt: int, response: int) -> dict:
    """`rows` random rows of left-padded prompts and right-padded responses, row i `i` tokens shorter in the
    prompt and `2 i` in the response (each row keeps one of each)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for i in range(rows):
        mask[i, min(i, prompt - 1):prompt + max(response - 2 * i, 1)] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].float(), "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="tiny", help="a Hugging Face model directory, tiny or smollm2")
    parser.add_argument("--mode", default="cold", choices=("cold", "eager"),
                        help="cold: compile at first use; eager: no compilation (what a step costs before the "
                             "compile lands)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--response", type=int, default=40)
    parser.add_argument("--after", type=int, default=3, help="steps to run")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (the default under 1B)")
    parser.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run_mode(args)
    steps = result["steps"]
    print(f"{args.mode}: first step {steps[0]['seconds']:.1f} s, later {steps[-1]['seconds']:.2f} s; "
          f"compile phases {result['compile_s']}", flush=True)
    write_json({"args": vars(args), "commit": git_commit(), "runs": [result]},
               args.out or HERE / "results" / f"compile_first_step_{args.device}.json")


if __name__ == "__main__":
    main()
