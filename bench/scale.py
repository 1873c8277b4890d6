"""GRPO at the Qwen2.5 1.5B, 3B, 7B and 14B shapes on one GPU: which configurations fit, the device peak,
the step time and tokens/s, with the default settings and with the memory options.

    python bench/scale.py --list                                         # the configurations
    python bench/scale.py --configs 1.5b:default,3b:default --budget-s 540 --out bench/results/scale_a.json
    python bench/scale.py --configs 7b:8bit,7b:cpu_offload --budget-s 540 --out bench/results/scale_b.json
    python bench/scale.py --configs 14b:bf16_8bit --budget-s 540 --out bench/results/scale_c.json
    python bench/scale.py --configs 7b:lora,14b:lora,14b:lora_kl --budget-s 540 --out bench/results/scale_lora.json
    python bench/scale.py --configs 30b-a3b:lora,30b-a3b:lora_replay --budget-s 540   # Qwen3-30B-A3B (docs/moe.md)
    python bench/scale.py --configs moe-small:routes,moe-small:replay,dense-small:default --steps 4   # mismatch
    python bench/scale.py --device cpu --configs tiny:default,tiny:cpu_offload,tiny:lora_kl   # a toy check on a CPU
    python bench/scale.py --device cpu --configs moe-tiny:routes,moe-tiny:lora_replay

Random weights at the real shapes and vocabularies, a 400-token tokenizer (sampled ids past it decode to
nothing), synthetic GSM8K-style prompts, 16 prompts x 8 samples, <= 512 new tokens, `--steps` steps (the
first compiles), the settings of `bench/grpo_vs_trl.py` plus each configuration's memory keys (`OPTIONS`; `lora`:
recipes/grpo_lora.yaml's adapters with the rollout colocated, `lora_kl` with its KL loss too, whose reference is
the base model under the adapters; for a mixture of experts `routes` records the rollout's routes and reports
router agreement without replaying them, `replay` replays them, `lora_replay` both with LoRA). `sync_s` is the
weight sync of the last step (`timing_s/update_weights`); `mismatch` the training-inference mismatch and router
metrics of each step (`rollout_corr/*`, `training/rollout_*`, `router/*`).
Each configuration runs in its own subprocess under a time limit, so an out-of-memory error or a hang is
recorded and the next one runs; one the device plan refuses is recorded with the plan's message (which
names the keys that would fit). A shape's model directory is built once (on the GPU, in a subprocess) and
deleted after its last configuration (a 14B one is 30 GB, Qwen3-30B-A3B's 61 GB: the build refuses to start
on a disk without room for it). The JSON is rewritten after every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_util import DeviceMemoryWatch, git_commit  # noqa: E402
from grpo_vs_trl import make_inputs, run_hybridflow  # noqa: E402

from hybridflow.utils.model_shapes import MOE_SHAPES, QWEN_SHAPES, tiny_model_kwargs  # noqa: E402

SHAPES = {"tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab=None),
          "moe-tiny": dict(arch="qwen3_moe", hidden=64, layers=2, heads=4, kv_heads=2, experts=8, experts_per_token=2,
                           vocab=None),
          **{name: {**tiny_model_kwargs(shape), "vocab": shape["vocab_size"]} for name, shape in QWEN_SHAPES.items()
             if name != "0.5b"},
          **{name.removeprefix("qwen3-"): {**tiny_model_kwargs(shape), "vocab": shape["vocab_size"]}
             for name, shape in MOE_SHAPES.items()}}
BF16_8BIT = ["model.dtype=bf16", "model.master_dtype=bf16", "actor.optimizer=adamw_8bit"]
LORA = ["actor.lora.rank=32", "actor.lora.alpha=32"]  # recipes/grpo_lora.yaml's adapters
ROUTES = ["rollout.record_routes=true"]
REPLAY = ROUTES + ["actor.router_replay=rollout"]
OPTIONS = {
    "default": [],
    "8bit": ["actor.optimizer=adamw_8bit"],
    "cpu_offload": ["actor.optimizer=adamw_cpu_offload"],
    "bf16_8bit": BF16_8BIT,
    "all": BF16_8BIT + ["model.gradient_checkpointing=true", "actor.param_offload=true",
                        "actor.optimizer_offload=true", "rollout.offload_weights=true"],
    "lora": LORA,
    "lora_kl": LORA + ["actor.kl_loss_coef=0.001"],
    "routes": ROUTES,
    "replay": REPLAY,
    "lora_replay": LORA + REPLAY,
}
DEFAULT_CONFIGS = ("1.5b:default", "3b:default", "7b:default", "7b:8bit", "7b:cpu_offload", "14b:default",
                   "14b:bf16_8bit", "14b:all")
MIN_START_S = 60  # a configuration is not started with less time than this left in the budget


def child(a: argparse.Namespace) -> None:
    """One configuration: the GRPO steps, or the error that stopped them, into `a.result`."""
    import hybridflow.trainer.rl

    # these runs never save a checkpoint; the trainer's up-front disk check (3x the weight files: 90 GB at
    # 14B) would refuse them on a machine whose disk holds the model and little more
    hybridflow.trainer.rl.checkpoint_bytes_needed = lambda cfg: 0
    watch = DeviceMemoryWatch() if a.device == "cuda" else None
    run = argparse.Namespace(work=a.work, device=a.device, prompts=a.prompts, n=a.n, max_new_tokens=a.max_new_tokens,
                             steps=a.steps, lr=1e-6, seed=0, profile=False,
                             set=OPTIONS[a.option] + ["trainer.val_before_train=false"])
    try:
        out = {"status": "ok", **run_hybridflow(run)}
    except Exception as e:  # recorded, not raised: the parent goes on with the next configuration
        text = str(e)
        status = ("refused" if "DoesNotFit" in text else
                  "out of memory" if "out of memory" in text.lower() or "OutOfMemory" in text else "error")
        out = {"status": status, "message": text[:4000]}
    if watch is not None:
        out["peak_device_memory_gb"] = watch.stop()
    Path(a.result).write_text(json.dumps(out))


def checkpoint_bytes(shape: dict) -> int:
    """The bf16 safetensors a shape's model directory holds (its parameters counted on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.utils.tiny_model import tiny_config

    keys = {k: v for k, v in shape.items() if k not in ("arch", "vocab", "tie_word_embeddings")}
    config = tiny_config(shape.get("arch", "qwen2"), shape.get("vocab") or 400, **keys,
                         tie_word_embeddings=shape.get("tie_word_embeddings", True))
    with torch.device("meta"):
        return 2 * sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def build(a: argparse.Namespace) -> None:
    """The shape's model directory and prompts (on the GPU for the large shapes); refused up front when the
    disk cannot hold the checkpoint."""
    shape = dict(SHAPES[a.shape])
    need, free = checkpoint_bytes(shape), shutil.disk_usage(Path(a.work).parent).free
    if need * 1.05 > free:
        sys.exit(f"the {a.shape} model directory needs {need / 2**30:.1f} GiB of disk, {free / 2**30:.1f} GiB is free "
                 f"under {a.work}: run on a machine with a larger disk (TMPDIR picks the folder)")
    vocab = shape.pop("vocab")
    make_inputs(Path(a.work), shape, a.prompts * (a.steps + 1), seed=0, vocab=vocab, device=a.device)


def summarize(config: str, r: dict, steps_total: int, wall_s: float, log: str) -> dict:
    out = {"config": config, "status": r.get("status", "error"), "wall_s": wall_s,
           "device_plan": next((line.split(": ", 1)[1] for line in log.splitlines()
                                if line.startswith("device plan of ")), None),
           "peak_device_memory_gb": r.get("peak_device_memory_gb"), "peak_allocated_gb": r.get("peak_memory_gb")}
    if "message" in r:
        out["message"] = r["message"]
    if not r.get("step_s"):  # cut short: the step times the log shows (run_hybridflow prints each)
        done = [float(line.rsplit(": ", 1)[1].rstrip("s")) for line in log.splitlines()
                if line.startswith("hybridflow step ")]
        if done:
            out.update(steps_done=len(done), steps_asked=steps_total, step_s_all=done)
    if r.get("step_s"):
        steady = r["step_s"][1:] or r["step_s"]  # the first step compiles
        out.update(steps_done=len(r["step_s"]), steps_asked=steps_total, step_s_all=r["step_s"],
                   step_s=statistics.median(steady),
                   tokens_per_s=statistics.median(r["tokens_per_s"][1:] or r["tokens_per_s"]),
                   gen_tokens_per_s=statistics.median(r["gen_tokens_per_s"][1:] or r["gen_tokens_per_s"]),
                   response_length_mean=statistics.mean(r["response_length_mean"]),
                   phases_s=r["phases_s"][-1], sync_s=r["phases_s"][-1].get("update_weights"),
                   mismatch=r.get("mismatch"))
        if r.get("mfu_actor"):
            out["mfu_actor"] = statistics.median(r["mfu_actor"][1:] or r["mfu_actor"])
    return out


def run_config(a: argparse.Namespace, config: str, work: Path, limit: float) -> dict:
    """Runs one configuration in a subprocess (its own session, so a timeout kills all it started)."""
    shape, option = config.split(":")
    result, log_path = work / f"{option}.json", work / f"{option}.log"
    cmd = [sys.executable, __file__, "--child", "--work", str(work), "--shape", shape, "--option", option,
           "--result", str(result), f"--device={a.device}", f"--prompts={a.prompts}", f"--n={a.n}",
           f"--max-new-tokens={a.max_new_tokens}", f"--steps={a.steps}"]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text(errors="replace")
    r = json.loads(result.read_text()) if result.exists() else {
        "status": "timeout" if proc.returncode == -signal.SIGKILL else "crashed",
        "message": f"exit code {proc.returncode} after {time.perf_counter() - start:.0f} s (limit {limit:.0f} s); "
                   f"log tail: {text[-2000:]}"}
    return summarize(config, r, a.steps, time.perf_counter() - start, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="shape:option,... (see --list)")
    p.add_argument("--list", action="store_true", help="print the shapes, options and default configurations")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=540.0, help="total seconds for all configurations")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/scale_<device>.json)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--option", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    if a.build:
        return build(a)
    if a.list:
        print("shapes:", ", ".join(SHAPES))
        for name, keys in OPTIONS.items():
            print(f"option {name}: {' '.join(keys) or '(none)'}")
        print("default configurations:", ",".join(DEFAULT_CONFIGS))
        return
    configs = a.configs.split(",")
    for config in configs:
        shape, _, option = config.partition(":")
        if shape not in SHAPES or option not in OPTIONS:
            p.error(f"configuration {config!r}: valid shapes {', '.join(SHAPES)}; options {', '.join(OPTIONS)}")
    deadline = time.monotonic() + a.budget_s
    root = Path(tempfile.mkdtemp(prefix="scale_"))
    out = Path(a.out or HERE / "results" / f"scale_{a.device}.json")
    report = {"settings": {k: v for k, v in vars(a).items() if k in ("device", "prompts", "n", "max_new_tokens",
                                                                      "steps", "budget_s")},
              "options": OPTIONS, "commit": git_commit(), "results": []}
    shapes = list(dict.fromkeys(c.split(":")[0] for c in configs))
    try:
        for shape in shapes:
            work = root / shape
            for config in (c for c in configs if c.split(":")[0] == shape):
                left = deadline - time.monotonic()
                if left < MIN_START_S:
                    report["results"].append({"config": config, "status": "skipped: time budget"})
                    continue
                if not (work / "model").exists():
                    start = time.perf_counter()
                    subprocess.run([sys.executable, __file__, "--build", "--work", str(work), "--shape", shape,
                                    f"--device={a.device}", f"--prompts={a.prompts}", f"--steps={a.steps}"],
                                   check=True, timeout=left)
                    report.setdefault("build_s", {})[shape] = time.perf_counter() - start
                    left = deadline - time.monotonic()
                entry = run_config(a, config, work, left)
                report["results"].append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k not in ("phases_s", "device_plan")}), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
            shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    print(f"\n{'config':<18}{'status':<16}{'s/step':>8}{'tok/s':>10}{'device GiB':>12}{'sync s':>8}")
    for r in report["results"]:
        print(f"{r['config']:<18}{r['status'][:15]:<16}{r.get('step_s') or 0:>8.2f}{r.get('tokens_per_s') or 0:>10,.0f}"
              f"{r.get('peak_device_memory_gb') or 0:>12.1f}{r.get('sync_s') or 0:>8.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
