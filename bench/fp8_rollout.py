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
weight bytes and the device's peak memory. FP8 runs twice: as the engine is (`fp8`: decode's GEMMs through the
weight-only kernel up to `fp8.WEIGHT_ONLY_MAX_ROWS` tokens) and with every GEMM through per-token quantize +
`torch._scaled_mm` (`fp8_scaled_mm`: the threshold at 0, the path before the weight-only kernel).

Then each projection of a layer at decode's 64, 128 and 256 rows and a prefill's 4,096, timed inside a CUDA graph as
the engine's decode replays them, over copies of the weight that together outgrow L2 (so each GEMM streams its
weight from HBM, as a step's distinct layers do): `F.linear` in bf16, `fp8.fp8_linear` as the engine calls it, the
weight-only kernel at its default tiles and at each tile of `TILE_SWEEP` (the fastest reported with its tiles;
each checked against the default's output first), per-token quantize + `_scaled_mm` together, the quantize alone
and the `_scaled_mm` alone (with and without `use_fast_accum`). Every case is guarded: a failure is recorded in the
JSON with its error, and the rest run.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
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
# the engine's FP8 runs: name -> fp8.WEIGHT_ONLY_MAX_ROWS while it is built and runs (None: the module's default)
FP8_VARIANTS = {"fp8": None, "fp8_scaled_mm": 0}
GEMM_ROWS = (64, 128, 256, 4096)
# the weight-only kernel's tiles swept per projection and row count: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILE_SWEEP = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
              (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3)]


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
               profile: bool, weight_only_max_rows: int | None = None) -> dict:
    default = fp8.WEIGHT_ONLY_MAX_ROWS
    if weight_only_max_rows is not None:  # read by every fp8_linear call, the graphs' capture included
        fp8.WEIGHT_ONLY_MAX_ROWS = weight_only_max_rows
    try:
        return _run_engine(config, device, dtype, quantization, prompts, new_tokens, bandwidth, profile)
    finally:
        fp8.WEIGHT_ONLY_MAX_ROWS = default


def _run_engine(config, device, dtype, quantization: str, prompts, new_tokens: int, bandwidth: float | None,
                profile: bool) -> dict:
    start = time.perf_counter()
    engine = RolloutEngine.from_config(config, random_weights(config, device, dtype), device, dtype, stop_token_ids=[],
                                       max_num_seqs=len(prompts), max_model_len=len(prompts[0]) + new_tokens,
                                       quantization=quantization)
    row: dict[str, Any] = dict(weight_only_max_rows=fp8.WEIGHT_ONLY_MAX_ROWS if quantization == "fp8" else None,
                               build_s=time.perf_counter() - start, kv_cache_gb=engine.stats["kv_cache_gb"],
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


def graph_ms(calls: list[Callable[[], Any]], replays: int = 20) -> float:
    """Milliseconds per call: one CUDA graph that runs every call once, replayed `replays` times (the median
    replay). Warmed up on a side stream first, so Triton's compiles and cuBLAS's choices stay out of the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls)


def tiles_of(tile: tuple[int, int, int, int, int]) -> dict[str, int]:
    block_m, block_n, block_k, warps, stages = tile
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def sweep_tiles(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The weight-only kernel at each tile of `TILE_SWEEP` that fits the rows: the fastest and its tiles, and every
    tile's time (a tile that fails to launch or disagrees with the default tiles' output is recorded as such)."""
    want = fp8.weight_only_linear(x, *weights[0], None).float()
    times: dict[str, Any] = {}
    for tile in TILE_SWEEP:
        if tile[0] > max(16, 2 * x.shape[0]):  # token tiles mostly past the rows
            continue
        try:
            got = fp8.weight_only_linear(x, *weights[0], None, tiles_of(tile)).float()
            if not torch.allclose(got, want, atol=1e-2, rtol=1e-2):
                times[str(tile)] = "wrong output"
                continue
            times[str(tile)] = graph_ms([lambda w=w, s=s, t=tiles_of(tile): fp8.weight_only_linear(x, w, s, None, t)
                                         for w, s in weights])
        except Exception as err:  # noqa: BLE001 - a tile past the shared memory: recorded, the sweep goes on
            times[str(tile)] = f"{type(err).__name__}: {str(err)[:200]}"
    timed = {tile: ms for tile, ms in times.items() if isinstance(ms, float)}
    best = min(timed, key=timed.__getitem__) if timed else None
    return dict(weight_only_best_ms=timed.get(best) if best else None, weight_only_best_tiles=best,
                weight_only_sweep_ms=times)


def run_gemms(config, device, dtype, rows: int) -> dict:
    """Each projection of a layer at `rows` tokens, in CUDA graphs over copies of its weight: bf16 `F.linear`, the
    FP8 linear as the engine calls it, the weight-only kernel (default tiles and the sweep, at decode's rows), per-token
    quantize + `_scaled_mm`, the quantize alone and the `_scaled_mm` alone."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv_width = config.num_key_value_heads * hidden // config.num_attention_heads
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    out: dict[str, Any] = {}
    for name, (n, k) in dict(qkv=(hidden + 2 * kv_width, hidden), o=(hidden, hidden), gate_up=(2 * inter, hidden),
                             down=(hidden, inter)).items():
        copies = max(2, math.ceil(2 * l2_bytes / (n * k)))  # the FP8 copies alone twice L2's size
        dense = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        weights = []
        for weight in dense:
            wq, ws = torch.empty(n, k, dtype=fp8.FP8, device=device), torch.empty(n, device=device)
            fp8.quantize_rows(weight, wq, ws)
            weights.append((wq, ws))
        x = torch.randn(rows, k, device=device, dtype=dtype)
        xq, xs = torch.empty(rows, k, dtype=fp8.FP8, device=device), torch.empty(rows, device=device)
        fp8.quantize_rows(x, xq, xs)

        row: dict[str, Any] = dict(n=n, k=k, copies=copies, weight_only_max_rows=fp8.WEIGHT_ONLY_MAX_ROWS,
                                   bf16_ms=graph_ms([lambda w=w: F.linear(x, w) for w in dense]),
                                   fp8_ms=graph_ms([lambda w=w, s=s: fp8.fp8_linear(x, w, s, None)
                                                    for w, s in weights]),
                                   quantized_ms=graph_ms([lambda w=w, s=s: fp8.scaled_linear(x, w, s, None)
                                                          for w, s in weights]),
                                   quantize_ms=graph_ms([lambda: fp8.quantize_rows(x, xq, xs)] * 8))
        # the GEMM alone, and with Hopper's fast accumulation (fewer promotions to fp32: faster, less exact), which
        # the engine does not use
        for key, fast in (("scaled_mm_ms", False), ("scaled_mm_fast_accum_ms", True)):
            row[key] = graph_ms([lambda w=w, s=s, fast=fast: torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1),
                                                                              scale_b=s.view(1, -1), out_dtype=dtype,
                                                                              use_fast_accum=fast)
                                 for w, s in weights])
        if rows <= max(GEMM_ROWS[:-1]):
            row.update(weight_only_ms=graph_ms([lambda w=w, s=s: fp8.weight_only_linear(x, w, s, None)
                                                for w, s in weights]),
                       weight_only_tiles=fp8.decode_tiles(rows, n), **sweep_tiles(x, weights))
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        out[name] = row
        del dense, weights
    return out


def print_gemms(report: dict) -> None:
    """Per shape, rows and projection: microseconds of bf16, the engine's FP8 linear, the weight-only kernel (default
    tiles, the sweep's best) and quantize + `_scaled_mm`."""
    print(f"\n{'shape':<6}{'rows':>5} {'proj':<8}{'bf16 us':>8}{'fp8 us':>8}{'w-only':>8}{'best':>8}{'q+mm us':>8}"
          f"  best tiles")
    for shape, row in report["shapes"].items():
        for rows, gemms in row.get("gemms", {}).items():
            if "error" in gemms:
                print(f"{shape:<6}{rows:>5} failed: {gemms['error']}")
                continue
            for name, g in gemms.items():
                if not isinstance(g, dict):
                    continue
                us = [1e3 * v if isinstance(v, float) else 0.0 for v in
                      (g["bf16_ms"], g["fp8_ms"], g.get("weight_only_ms"), g.get("weight_only_best_ms"),
                       g["quantized_ms"])]
                print(f"{shape:<6}{rows:>5} {name:<8}" + "".join(f"{v:>8.1f}" for v in us)
                      + f"  {g.get('weight_only_best_tiles') or ''}")


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
        row: dict[str, Any] = dict(bf16=guarded(f"{shape} none", lambda: run_engine(
            config, device, dtype, "none", prompts, new, bandwidth, False)))
        for variant, max_rows in FP8_VARIANTS.items():
            row[variant] = guarded(f"{shape} {variant}", lambda: run_engine(
                config, device, dtype, "fp8", prompts, new, bandwidth, a.profile and variant == "fp8", max_rows))
        if "tokens_per_s" in row["bf16"]:
            for variant in FP8_VARIANTS:
                if "tokens_per_s" in row[variant]:
                    row["speedup" if variant == "fp8" else f"speedup_{variant}"] = \
                        row[variant]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
            row["target"] = TARGETS.get(shape)
        if gpu:
            row["gemms"] = {str(rows): guarded(f"{shape} gemms {rows}", lambda: run_gemms(config, device, dtype, rows))
                            for rows in GEMM_ROWS}
        report["shapes"][shape] = row
    if gpu:
        print_gemms(report)
    print(f"\n{'shape':<6}{'precision':<14}{'tok/s':>10}{'step ms':>9}{'floor ms':>9}{'sync s':>8}{'weights GB':>11}"
          f"{'peak GB':>9}")
    for shape, row in report["shapes"].items():
        for precision in ("bf16", *FP8_VARIANTS):
            r = row[precision]
            if "error" in r:
                print(f"{shape:<6}{precision:<14} failed: {r['error']}")
                continue
            print(f"{shape:<6}{precision:<14}{r['tokens_per_s']:>10,.0f}{r['decode_step_ms']:>9.2f}"
                  f"{r.get('floor_step_ms') or 0:>9.2f}{r['timing_s/update_weights']:>8.3f}{r['weights_gb']:>11.2f}"
                  f"{r.get('peak_memory_gb') or 0:>9.2f}")
        if "speedup" in row:
            print(f"{shape:<6}fp8 / bf16 = {row['speedup']:.2f}x (target {row['target']}; weight-only up to "
                  f"{row['fp8']['weight_only_max_rows']} rows)")
        if "speedup_fp8_scaled_mm" in row:
            print(f"{shape:<6}fp8_scaled_mm / bf16 = {row['speedup_fp8_scaled_mm']:.2f}x")
    write_json(report, a.out or f"bench/results/fp8_rollout_{a.device}.json")


if __name__ == "__main__":
    main()
