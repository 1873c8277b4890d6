"""GRPO on small cards, proven on a big one: each setting of issue 54's table runs under `trainer.device_memory_gib`
(the plan budgets that much and the allocator is held to it), beside the uncapped steps it is compared with.

    python bench/small_gpu.py --device cuda --settings 1.5b --out bench/results/small_gpu_1.5b.json
    python bench/small_gpu.py --device cuda --settings 7b --out bench/results/small_gpu_7b.json
    python bench/small_gpu.py --device cpu --settings 1.5b_nf4_lora_6gib   # a smoke test: the tiny shape

Random weights at the real Qwen2.5 shapes (`hybridflow.utils.model_shapes`, real vocabulary), synthetic GSM8K-style
prompts, 16 prompts x 8 samples, at most 512 new tokens, 3 steps (the step time is the median of the steps after the
first); the run itself is `bench/grpo_vs_trl.py`'s (`make_inputs`, `run_hybridflow`). Each setting runs in its own
subprocess with a time budget (`--budget-s`), so a setting that is refused (the plan's `DoesNotFit` names the keys),
runs out of memory or runs out of time is recorded in the JSON with the tail of its error, and the others still run.
Per setting: the keys it sets, the cap and the issue's ceiling, seconds per step, the allocator's peak, the device's
whole used memory (sampled every 50 ms: the CUDA context and memory outside the allocator included), and where the
issue asks for it the step against the uncapped one. Prints a table and writes JSON (`--out`).

What the plan assumes lies outside the allocator (`hybridflow.engine.budget.cap.OUTSIDE_ALLOCATOR_BYTES`, subtracted
from the cap) is checked here: `context_gib` is the device's used memory once the process's CUDA context exists,
before any tensor (`torch.cuda.mem_get_info`; the device holds nothing else); `allocator_reserved_peak_gib` the
caching allocator's reserved peak; `device_over_cap_gib` the device's peak less the cap, which is at most 0 when
the cap holds the whole process (context, libraries, the KV cache mapped outside the allocator included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# before hybridflow, which sets PYTORCH_CUDA_ALLOC_CONF where it is unset: bench_util keeps the user's value
from bench_util import DeviceMemoryWatch, child_env, git_commit, peak_memory_gb, write_json
from grpo_vs_trl import SHAPES, make_inputs, run_hybridflow

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hybridflow.utils.model_shapes import QWEN_SHAPES, tiny_model_kwargs  # noqa: E402

LORA = ["actor.lora.rank=32", "actor.lora.alpha=64"]
NF4 = ["model.quantization=nf4", *LORA]
# (shape, keys, cap GiB or None, the ceiling GiB or None, the uncapped setting its step is compared with).
# The plan chooses checkpointing, micro-batches, the KV cache, the optimizer and the optimizer / rollout-weight
# offloads; a setting sets only what the plan does not choose, as its refusal names it (docs/small_gpus.md): bf16
# master weights, the actor's parameter offload, fewer rollout slots.
SETTINGS: dict[str, tuple[str, list[str], float | None, float | None, str | None]] = {
    "1.5b_lora_uncapped": ("1.5b", LORA, None, None, None),
    "1.5b_full_uncapped": ("1.5b", [], None, None, None),
    "1.5b_nf4_lora_6gib": ("1.5b", [*NF4, "rollout.max_num_seqs=128"], 6, 6, "1.5b_lora_uncapped"),
    "1.5b_nf4_lora_8gib": ("1.5b", NF4, 8, None, "1.5b_lora_uncapped"),
    "1.5b_nf4_lora_7gib": ("1.5b", NF4, 7, None, "1.5b_lora_uncapped"),
    "1.5b_full_16gib": ("1.5b", ["model.master_dtype=bf16", "model.dtype=bf16"], 16, 16, "1.5b_full_uncapped"),
    "7b_lora_24gib": ("7b", [*LORA, "actor.param_offload=true"], 24, 24, None),
    "7b_nf4_lora_16gib": ("7b", [*NF4, "rollout.max_num_seqs=128"], 16, 16, None),
    "7b_nf4_lora_24gib": ("7b", NF4, 24, None, None),
}


def shape_kwargs(shape: str, device: str) -> dict:
    """`build_tiny_model`'s keywords of a shape: the real one on a GPU, the tiny one on a CPU (a smoke test)."""
    return tiny_model_kwargs(QWEN_SHAPES[shape]) if device == "cuda" else SHAPES["tiny"]


def chosen(names: str) -> list[str]:
    """`--settings`: setting names or shapes (`1.5b`: every setting of that shape), comma-separated."""
    out: list[str] = []
    for name in names.split(","):
        picked = [s for s, spec in SETTINGS.items() if name in (s, spec[0])]
        if not picked:
            raise SystemExit(f"--settings: {name!r} is neither a setting nor a shape; valid: "
                             f"{', '.join(SETTINGS)}, 1.5b, 7b")
        out += [s for s in picked if s not in out]
    return out


def run_args(a: argparse.Namespace, work: Path, keys: list[str], cap: float | None) -> argparse.Namespace:
    """`grpo_vs_trl.run_hybridflow`'s arguments for one setting."""
    overrides = [*keys, "trainer.val_every=0", "trainer.save_every=0", *a.set]
    if cap is not None:
        overrides.append(f"trainer.device_memory_gib={cap}")
    return argparse.Namespace(work=str(work), prompts=a.prompts, n=a.n, max_new_tokens=a.max_new_tokens,
                              steps=a.steps, lr=1e-5, device=a.device, seed=0, set=overrides, profile=False,
                              trace=None)


def child(a: argparse.Namespace) -> None:
    """One setting's run (or, `--child make`, one shape's model and prompts) in this process."""
    work = Path(a.work)
    if a.child == "make":
        make_inputs(work, shape_kwargs(a.shape, a.device), a.prompts * (a.steps + 1), 0,
                    151936 if a.device == "cuda" else None, a.device)
        return
    shape, keys, cap, _, _ = SETTINGS[a.child]
    context = None
    if a.device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()  # the first CUDA call: the context exists, no tensor yet
        context = (total - free) / 2**30
    watch = DeviceMemoryWatch() if a.device == "cuda" else None
    result = run_hybridflow(run_args(a, work, keys, cap))
    result["peak_device_memory_gb"] = watch.stop() if watch is not None else None
    result["peak_memory_gb"] = peak_memory_gb(a.device)
    result["context_gib"] = context
    if a.device == "cuda":
        result["allocator_reserved_peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
    Path(a.result).write_text(json.dumps(result))


def spawn(a: argparse.Namespace, role: str, work: Path, result: Path | None = None) -> tuple[int | None, str]:
    """Runs `child` for `role` in a subprocess within `--budget-s`; (its exit code, None if stopped, stderr)."""
    cmd = [sys.executable, __file__, "--child", role, "--work", str(work), f"--device={a.device}",
           f"--prompts={a.prompts}", f"--n={a.n}", f"--max-new-tokens={a.max_new_tokens}", f"--steps={a.steps}"]
    cmd += [f"--shape={SETTINGS[role][0] if role in SETTINGS else a.shape}"]
    cmd += [f"--result={result}"] if result is not None else []
    cmd += [f"--set={kv}" for kv in a.set]
    try:
        proc = subprocess.run(cmd, env=child_env("hybridflow"), stderr=subprocess.PIPE, text=True,
                              timeout=a.budget_s)
        return proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        return None, e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""


def summary(name: str, r: dict) -> dict:
    """A setting's figures from its run: steps after the first make the median."""
    shape, keys, cap, ceiling, _ = SETTINGS[name]
    steady = r["step_s"][1:] or r["step_s"]
    out = {"shape": shape, "keys": keys, "device_memory_gib": cap, "ceiling_gib": ceiling,
           "step_s_median": statistics.median(steady), "step_s_all": r["step_s"],
           "peak_memory_gb": r["peak_memory_gb"], "peak_device_memory_gb": r["peak_device_memory_gb"],
           "response_length_mean": statistics.mean(r["response_length_mean"]),
           "phases_s_all": r["phases_s"]}
    if ceiling is not None:  # the whole device's use where it was sampled (what a card of that size must hold)
        out["within_ceiling"] = (r["peak_device_memory_gb"] or r["peak_memory_gb"]) <= ceiling
    out["context_gib"] = r.get("context_gib")
    out["allocator_reserved_peak_gib"] = r.get("allocator_reserved_peak_gib")
    if cap is not None and r["peak_device_memory_gb"] is not None:  # > 0: memory outside the cap's hold
        out["device_over_cap_gib"] = r["peak_device_memory_gb"] - cap
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--settings", default="1.5b,7b", help=f"comma-separated: {', '.join(SETTINGS)}, or a shape")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds a setting's subprocess may run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override for every setting (repeatable), e.g. model.compile=false")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/small_gpu_<device>.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    names = chosen(a.settings)
    root = Path(tempfile.mkdtemp(prefix="small_gpu_"))
    results: dict[str, dict] = {}
    made: dict[str, str | None] = {}  # shape -> why its inputs could not be made (None: made)
    for name in names:
        shape = SETTINGS[name][0]
        work = root / shape
        if shape not in made:  # the random model is made in a process of its own, so no CUDA memory lingers
            a.shape = shape
            code, err = spawn(a, "make", work)
            made[shape] = None if code == 0 else f"making the {shape} model: exit {code}: {err[-2000:]}"
        start = time.perf_counter()
        if made[shape] is not None:
            results[name] = {"shape": shape, "error": made[shape]}
            continue
        res = root / f"{name}.json"
        code, err = spawn(a, name, work, res)
        if code == 0 and res.exists():
            results[name] = summary(name, json.loads(res.read_text()))
        else:
            why = f"stopped after {a.budget_s} s" if code is None else f"exit code {code}"
            sys.stderr.write(f"{name}: {why}\n{err[-4000:]}\n")
            results[name] = {"shape": shape, "keys": SETTINGS[name][1], "device_memory_gib": SETTINGS[name][2],
                             "error": why, "stderr_tail": err[-4000:]}
        results[name]["wall_s"] = time.perf_counter() - start
    for name, r in results.items():
        base = SETTINGS[name][4]
        if "step_s_median" in r and "step_s_median" in results.get(base or "", {}):
            r["step_over_uncapped"] = r["step_s_median"] / results[base]["step_s_median"]
    import torch

    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "cpus": os.cpu_count(),
              "torch": torch.__version__, "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items() if k in ("prompts", "n", "max_new_tokens", "steps", "set")},
              "results": results}
    print(f"\n{'setting':<22}{'cap GiB':>8}{'ceiling':>8}{'s/step':>9}{'peak GiB':>10}{'device GiB':>11}"
          f"{'over cap':>9}{'context':>8}{'x uncapped':>11}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22} failed: {r['error']} (stderr tail in the JSON)")
            continue
        ratio = f"{r['step_over_uncapped']:.2f}" if "step_over_uncapped" in r else "-"
        over = f"{r['device_over_cap_gib']:.2f}" if "device_over_cap_gib" in r else "-"
        context = f"{r['context_gib']:.2f}" if r.get("context_gib") is not None else "-"
        print(f"{name:<22}{r['device_memory_gib'] or '-':>8}{r['ceiling_gib'] or '-':>8}{r['step_s_median']:>9.2f}"
              f"{r['peak_memory_gb']:>10.2f}{r['peak_device_memory_gb'] or 0:>11.2f}{over:>9}{context:>8}{ratio:>11}")
    write_json(report, a.out or HERE / "results" / f"small_gpu_{a.device}.json")


if __name__ == "__main__":
    main()
