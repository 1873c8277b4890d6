"""Rollout throughput of a mixture of experts: our engine on the Qwen3-30B-A3B shape against the dense Qwen3 of
its active parameters and against `transformers.generate`, in one run.

    python bench/moe_rollout.py --device cuda --out bench/results/moe_rollout_h200.json
    python bench/moe_rollout.py --device cpu      # toy shapes (a 2-layer Qwen3-MoE and its dense twin), fp32
    python bench/moe_rollout.py --device cuda --profile   # + where the MoE and dense decode steps' time goes

Random weights (N(0, 0.02), norms 1: a near-uniform router, so a decode step of 256 rows touches almost every
expert) at the real shapes and vocabulary, built on the device tensor by tensor (no checkpoint on disk, no
second copy), batch 256, prompt 128 + 256 new tokens, EOS ignored, temperature 1. Each engine: our MoE engine
per experts' kernel (`--moe-kernels`) with routes recorded (as an RL run with `rollout.record_routes` runs it)
and, with the first kernel, without; the dense model; then `transformers.generate` on the MoE (its default
grouped_mm experts, SDPA, dynamic cache; `--hf-new-tokens` new tokens, fewer: its steps are slower). Reported
per run: tokens/s (prefill and all host work included), the mean decode step, and the step's floor: the
weights a step reads (attention and head, plus the experts 256 rows touch under uniform routing) and the mean
KV context, over the device-copy bandwidth measured in the run (bench/rollout.py's convention). The JSON
records each run's device peak memory.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from collections.abc import Iterator

import torch

from bench_util import git_commit, write_json
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.utils.model_shapes import moe_shape_config
from hybridflow.utils.moe_spec import moe_spec
from hybridflow.utils.tiny_model import tiny_config
from rollout import copy_bandwidth
from rollout_long import profile_generate
from rollout_util import hf_generate, sync


def configs(device: torch.device) -> tuple:
    """(MoE config, dense config of its active parameters)."""
    if device.type == "cuda":
        return moe_shape_config("qwen3-30b-a3b"), moe_shape_config("qwen3-dense-a3b")
    moe = tiny_config("qwen3_moe", 512, hidden=64, layers=2, experts=8, experts_per_token=2, expert_intermediate=32)
    return moe, tiny_config("qwen3", 512, hidden=64, layers=2, intermediate=2 * 32)


def random_weights(config, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, random tensor on `device`) for every parameter, made one at a time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = [(n, p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    gen = torch.Generator(device).manual_seed(0)
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            yield name, torch.randn(shape, device=device, dtype=dtype, generator=gen) * 0.02


def step_bytes(config, rows: int, context: float, dtype: torch.dtype) -> float:
    """Bytes one decode step of `rows` rows reads: every weight but the experts, the experts they touch under
    uniform routing (each one with probability 1 - (1 - k/E)^rows), and each row's KV over `context` tokens."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    spec = moe_spec(config)
    if spec is not None:
        per_layer = spec.expert_params(config.hidden_size)
        touched = 1 - (1 - spec.top_k / spec.num_experts) ** rows
        params -= len(spec.sparse_layers) * per_layer * (1 - touched)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * rows
    return (params + kv) * dtype.itemsize


def build(config, device, dtype, prompts, new_tokens: int, **engine_kw) -> RolloutEngine:
    """Our engine over random weights, sized for `prompts` with `new_tokens` each."""
    return RolloutEngine.from_config(config, random_weights(config, device, dtype), device, dtype, stop_token_ids=[],
                                     max_num_seqs=len(prompts), max_model_len=len(prompts[0]) + new_tokens,
                                     **engine_kw)


def run_ours(name: str, config, device, dtype, prompts, new_tokens: int, bandwidth, **engine_kw) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = build(config, device, dtype, prompts, new_tokens, **engine_kw)
    build_s = time.perf_counter() - start
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=0)
    engine.generate(prompts[:8], SamplingParams(temperature=1.0, max_tokens=4, stop_token_ids=[]))  # warm-up
    sync(device)
    start = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    stats = engine.stats
    step_ms = stats["decode_s"] / max(stats["decode_steps"], 1) * 1e3
    row = dict(model=name, engine="hybridflow", **{k: v for k, v in engine_kw.items()}, batch=len(prompts),
               tokens_per_s=len(prompts) * new_tokens / seconds, seconds=seconds, decode_step_ms=step_ms,
               prefill_s=stats["prefill_s"], build_s=build_s, graph_capture_s=stats.get("graph_capture_s"),
               kv_cache_gb=stats["kv_cache_gb"])
    if bandwidth:
        floor_ms = step_bytes(config, len(prompts), len(prompts[0]) + new_tokens / 2, dtype) / bandwidth * 1e3
        row.update(floor_step_ms=floor_ms, floor_fraction=floor_ms / step_ms)
    if device.type == "cuda":
        row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_generate(config, device, dtype, prompts, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)
    hf_generate(model, ids[:8], 4)  # warm-up
    out, seconds = hf_generate(model, ids, new_tokens)
    row = dict(model="moe", engine="transformers.generate", batch=len(prompts), new_tokens=new_tokens,
               experts_implementation=model.config._experts_implementation, tokens_per_s=out.numel() / seconds,
               seconds=seconds)
    if device.type == "cuda":
        row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    del model
    gc.collect()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=None, help="default 256 on a GPU, 8 on a CPU")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; 16 on a CPU)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256; 16 on a CPU")
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--moe-kernels", default=None, help="comma-separated (default grouped_mm,triton on a GPU)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true", help="then torch.profiler over one more MoE run (the first "
                   "kernel, routes recorded) and one more dense run: where each decode step's time goes, kernel "
                   "by kernel, into the JSON (the shared part, attention and head, measured on both)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    batch, prompt = a.batch or (256 if gpu else 8), a.prompt or (128 if gpu else 16)
    new = a.new_tokens or (256 if gpu else 16)
    kernels = (a.moe_kernels or ("grouped_mm,triton" if gpu else "grouped_mm")).split(",")
    moe, dense = configs(device)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(moe.vocab_size, 1000), (batch, prompt), generator=gen).tolist()
    bandwidth = copy_bandwidth(device) if gpu else None
    rows = []
    for i, kernel in enumerate(kernels):
        for record in ((True, False) if i == 0 else (True,)):
            rows.append(run_ours("moe", moe, device, dtype, prompts, new, bandwidth, moe_kernel=kernel,
                                 record_routes=record))
            print(rows[-1], flush=True)
    rows.append(run_ours("dense", dense, device, dtype, prompts, new, bandwidth))
    print(rows[-1], flush=True)
    if not a.skip_hf:
        rows.append(run_generate(moe, device, dtype, prompts, min(a.hf_new_tokens, new)))
        print(rows[-1], flush=True)
    dense_tok_s = next(r["tokens_per_s"] for r in rows if r["model"] == "dense")
    generate = next((r["tokens_per_s"] for r in rows if r["engine"] == "transformers.generate"), None)
    for r in rows:
        if r["model"] == "moe" and r["engine"] == "hybridflow":
            r["vs_dense"] = r["tokens_per_s"] / dense_tok_s
            if generate:
                r["vs_generate"] = r["tokens_per_s"] / generate
    report = dict(commit=git_commit(), device=torch.cuda.get_device_name() if gpu else platform.processor(),
                  torch=torch.__version__, dtype=str(dtype), batch=batch, prompt=prompt, new_tokens=new,
                  copy_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9, results=rows)
    if a.profile:
        engine = build(moe, device, dtype, prompts, new, moe_kernel=kernels[0], record_routes=True)
        report["profile"] = dict(moe_kernel=kernels[0], **profile_generate(engine, prompts, new))
        del engine
        engine = build(dense, device, dtype, prompts, new)
        report["profile_dense"] = profile_generate(engine, prompts, new)
        del engine
    print(f"\n{'model':<7}{'engine':<23}{'kernel':<12}{'routes':<8}{'tok/s':>10}{'step ms':>9}{'floor ms':>9}"
          f"{'vs dense':>9}")
    for r in rows:
        print(f"{r['model']:<7}{r['engine']:<23}{r.get('moe_kernel', ''):<12}{str(r.get('record_routes', '')):<8}"
              f"{r['tokens_per_s']:>10,.0f}{r.get('decode_step_ms', 0):>9.2f}{r.get('floor_step_ms', 0):>9.2f}"
              f"{r.get('vs_dense', 0):>9.2f}")
    write_json(report, a.out or f"bench/results/moe_rollout_{a.device}.json")


if __name__ == "__main__":
    main()
