"""FP8 rollout (`rollout.quantization=fp8`) against bf16: tokens/s, decode step, weight sync and device peak memory at
batch 256, at the Qwen2.5-1.5B and 7B shapes, plus the decode step's projections alone.

    python bench/fp8_rollout.py --device cuda --out bench/results/fp8_rollout_h200.json
    python bench/fp8_rollout.py --device cuda --shapes 1.5b --profile   # + where the FP8 decode step's time goes
    python bench/fp8_rollout.py --device cpu      # toy shape, fp32, FP8 through torch's CPU _scaled_mm (smoke)

Random weights (N(0, 0.02), norms 1) at the real shapes and vocabulary, made on the device tensor by tensor
(bench/moe_rollout.py's `random_weights`), prompt 128 + 256 new tokens, EOS ignored, temperature 1. Per shape and
precision (bf16 first, then fp8): the engine built over the weights, the weight sync (`load_weights` of every HF
tensor: the FP8 engine requantizes them), a warm-up, one timed `generate` (tokens/s with prefill and host work),
the mean decode step and its floor (the bytes a step reads: the layers' weights at 1 byte in FP8, 2 in bf16, the
embeddings and head at 2, the mean KV context, over the device-copy bandwidth measured in the run), the engine's
weight bytes and the device's peak memory. Then each projection of a decode step (M = 256, and a prefill's 4,096
rows) timed alone: `F.linear` in bf16 against `fp8.fp8_linear` (per-token quantize + `torch._scaled_mm`), the
quantize kernel alone and the `_scaled_mm` alone (with and without `use_fast_accum`). Every case is guarded: a
failure is recorded in the JSON with its error, and the rest run.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench_util import git_commit, write_json
from hybridflow.engine.rollout import RolloutEngine, SamplingParams, fp8
from hybridflow.utils.model_shapes import QWEN_SHAPES
from moe_rollout import random_weights
from rollout import copy_bandwidth
from rollout_long import profile_generate
from rollout_util import ours_generate, sync

TOY = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, tie_word_embeddings=True)
TARGETS = {"1.5b": 1.5, "7b": 1.6}  # issue 54: FP8 tok/s over bf16 at batch 256


def shape_config(shape: str):
    from transformers import AutoConfig

    sizes = TOY if shape == "toy" else QWEN_SHAPES[shape]
    return AutoConfig.for_model("qwen2", eos_token_id=None, bos_token_id=None, pad_token_id=0,
                                max_position_embeddings=4096, **sizes)


def guarded(name: str, fn: Callable[[], dict]) -> dict:
    """fn's row, or {error, traceback} when it raises (the device's memory released either way)."""
    try:
        row = fn()
    except Exception as err:  # noqa: BLE001 - a benchmark records a failing case and goes on to the next
        row = dict(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-2000:])
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "traceback"}, flush=True)
    return dict(case=name, **row)


def step_floor_bytes(config, quantized: bool, rows: int, context: float) -> float:
    """Bytes a decode step reads: the decoder layers' projections (1 byte a weight in FP8, 2 in bf16), the
    embedding rows (negligible) and the head (2 bytes), and each row's K/V over `context` tokens."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv_width = config.num_key_value_heads * head_dim
    projections = layers * (hidden * (hidden + 2 * kv_width) + hidden * hidden + 3 * hidden * inter)
    head = config.vocab_size * hidden
    kv = 2 * layers * kv_width * context * rows * 2
    return projections * (1 if quantized else 2) + head * 2 + kv


def run_engine(config, device, dtype, quantization: str, prompts, new_tokens: int, bandwidth: float | None,
               profile: bool) -> dict:
    start = time.perf_counter()
    engine = RolloutEngine.from_config(config, random_weights(config, device, dtype), device, dtype, stop_token_ids=[],
                                       max_num_seqs=len(prompts), max_model_len=len(prompts[0]) + new_tokens,
                                       quantization=quantization)
    row: dict[str, Any] = dict(build_s=time.perf_counter() - start, kv_cache_gb=engine.stats["kv_cache_gb"],
                               graph_capture_s=engine.stats.get("graph_capture_s"),
                               weights_gb=sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30)
    syncs = []
    for _ in range(2):
        tensors = list(random_weights(config, device, dtype))
        sync(device)
        start = time.perf_counter()
        engine.load_weights(tensors)
        sync(device)
        syncs.append(time.perf_counter() - start)
        del tensors
    row["timing_s/update_weights"] = min(syncs)
    engine.generate(prompts[:8], SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=[]))  # warm-up
    if device.type == "cuda":  # the generation's peak: the engine's weights, KV cache and activations, not the sync's
        torch.cuda.reset_peak_memory_stats(device)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=0)
    outs, seconds = ours_generate(engine, prompts, params)
    stats = engine.stats
    step_ms = 1e3 * stats["decode_s"] / max(stats["decode_steps"], 1)
    row.update(tokens_per_s=sum(len(o[0].token_ids) for o in outs) / seconds, seconds=seconds,
               prefill_s=stats["prefill_s"], decode_step_ms=step_ms)
    if bandwidth:
        floor = 1e3 * step_floor_bytes(config, quantization == "fp8", len(prompts), len(prompts[0]) + new_tokens / 2)
        row.update(floor_step_ms=floor / bandwidth, floor_fraction=floor / bandwidth / step_ms)
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if profile:
        row["profile"] = profile_generate(engine, prompts, new_tokens)
    del engine
    return row


def timed_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - start) / repeats


def run_gemms(config, device, dtype, rows: int) -> dict:
    """Each projection of a layer at `rows` tokens: bf16 `F.linear`, the FP8 linear, the activation quantize alone."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv_width = config.num_key_value_heads * hidden // config.num_attention_heads
    out: dict[str, Any] = {}
    for name, (n, k) in dict(qkv=(hidden + 2 * kv_width, hidden), o=(hidden, hidden), gate_up=(2 * inter, hidden),
                             down=(hidden, inter)).items():
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        x = torch.randn(rows, k, device=device, dtype=dtype)
        wq, ws = torch.empty(n, k, dtype=fp8.FP8, device=device), torch.empty(n, device=device)
        fp8.quantize_rows(weight, wq, ws)
        xq, xs = torch.empty(rows, k, dtype=fp8.FP8, device=device), torch.empty(rows, device=device)
        bf16_ms = timed_ms(lambda: F.linear(x, weight), device)
        fp8_ms = timed_ms(lambda: fp8.fp8_linear(x, wq, ws, None), device)
        quant_ms = timed_ms(lambda: fp8.quantize_rows(x, xq, xs), device)
        # the GEMM alone, and with Hopper's fast accumulation (fewer promotions to fp32: faster, less exact), which
        # the engine does not use
        gemm = {fast: timed_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                                        out_dtype=dtype, use_fast_accum=fast), device)
                for fast in (False, True)}
        out[name] = dict(n=n, k=k, bf16_ms=bf16_ms, fp8_ms=fp8_ms, quantize_ms=quant_ms, scaled_mm_ms=gemm[False],
                         scaled_mm_fast_accum_ms=gemm[True], speedup=bf16_ms / fp8_ms)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shapes", default=None, help="comma-separated among 0.5b,1.5b,3b,7b,14b (default 1.5b,7b; toy "
                                                  "on a CPU)")
    p.add_argument("--batch", type=int, default=None, help="default 256 on a GPU, 8 on a CPU")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; 16 on a CPU)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256; 16 on a CPU")
    p.add_argument("--profile", action="store_true", help="torch.profiler over one more FP8 run per shape (in the "
                   "JSON: where its decode step's time goes)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = (a.shapes or ("1.5b,7b" if gpu else "toy")).split(",")
    batch, prompt = a.batch or (256 if gpu else 8), a.prompt or (128 if gpu else 16)
    new = a.new_tokens or (256 if gpu else 16)
    bandwidth = copy_bandwidth(device) if gpu else None
    report: dict[str, Any] = dict(commit=git_commit(),
                                  device=torch.cuda.get_device_name() if gpu else platform.processor(),
                                  capability=list(torch.cuda.get_device_capability()) if gpu else None,
                                  torch=torch.__version__, dtype=str(dtype), batch=batch, prompt=prompt, new_tokens=new,
                                  copy_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9, shapes={})
    for shape in shapes:
        config = shape_config(shape)
        prompts = torch.randint(4, min(config.vocab_size, 1000), (batch, prompt),
                                generator=torch.Generator().manual_seed(0)).tolist()
        row: dict[str, Any] = {}
        for quantization in ("none", "fp8"):
            row["bf16" if quantization == "none" else "fp8"] = guarded(
                f"{shape} {quantization}", lambda: run_engine(config, device, dtype, quantization, prompts, new,
                                                              bandwidth, a.profile and quantization == "fp8"))
        if "tokens_per_s" in row["bf16"] and "tokens_per_s" in row["fp8"]:
            row["speedup"] = row["fp8"]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
            row["target"] = TARGETS.get(shape)
        if gpu:
            row["gemms"] = {str(rows): guarded(f"{shape} gemms {rows}", lambda: run_gemms(config, device, dtype, rows))
                            for rows in (batch, 4096)}
        report["shapes"][shape] = row
    print(f"\n{'shape':<6}{'precision':<10}{'tok/s':>10}{'step ms':>9}{'floor ms':>9}{'sync s':>8}{'weights GB':>11}"
          f"{'peak GB':>9}")
    for shape, row in report["shapes"].items():
        for precision in ("bf16", "fp8"):
            r = row[precision]
            if "error" in r:
                print(f"{shape:<6}{precision:<10} failed: {r['error']}")
                continue
            print(f"{shape:<6}{precision:<10}{r['tokens_per_s']:>10,.0f}{r['decode_step_ms']:>9.2f}"
                  f"{r.get('floor_step_ms') or 0:>9.2f}{r['timing_s/update_weights']:>8.3f}{r['weights_gb']:>11.2f}"
                  f"{r.get('peak_memory_gb') or 0:>9.2f}")
        if "speedup" in row:
            print(f"{shape:<6}fp8 / bf16 = {row['speedup']:.2f}x (target {row['target']})")
    write_json(report, a.out or f"bench/results/fp8_rollout_{a.device}.json")


if __name__ == "__main__":
    main()
