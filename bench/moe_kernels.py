"""The routed experts' grouped GEMMs alone: torch._grouped_mm against the Triton grouped GEMM (a sweep of its
tiles) and the gather fallback, at decode and prefill token counts, as the rollout engine runs them.

    python bench/moe_kernels.py --device cuda --out bench/results/moe_kernels_h200.json  # 30B-A3B, small shapes
    python bench/moe_kernels.py --device cpu                                             # a toy shape

Each case is one sparse layer's `grouped_gemm.expert_mlp` (sort the token-expert pairs, both GEMMs, SiLU, the
weighted sum), in bf16 on a GPU, on T tokens routed uniformly at random to their top-k of E experts (a
balanced router). On a GPU each case is captured in a CUDA graph (as the decode step is) and replayed; the time
is the mean over the replays. Floor: the weights of the experts the tokens touch, read once, over the device-copy
bandwidth (read + write) measured in the same run, bench/rollout.py's roofline convention (a decode step of a
few hundred tokens is bound by that read). Every
kernel's output is compared with grouped_mm's (max abs difference). The JSON records the device's peak memory.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time

import torch

from bench_util import git_commit, write_json
from hybridflow.engine.rollout.grouped_gemm import TILES, expert_mlp
from hybridflow.engine.rollout.kernels import silu_mul
from rollout import copy_bandwidth

# hidden, expert width, experts, experts per token
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-moe-small": (1024, 256, 64, 8), "toy": (64, 32, 8, 2)}
GPU_TOKENS = (1, 16, 64, 128, 256, 1024, 4096, 16384)
TRITON_TILES = [dict(block_m=m, block_n=n, block_k=k) for m, (n, k) in
                itertools.product((16, 32, 64), ((64, 64), (128, 64), (64, 128)))]
GATHER_MAX_TOKENS = 256  # the gather fallback materialises each pair's expert weights


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call: a CUDA graph of `fn` replayed `repeats` times on a GPU, the median of eager calls on
    a CPU."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def bench_shape(name: str, tokens: tuple[int, ...], device: torch.device, dtype: torch.dtype, bandwidth: float | None,
                repeats: int) -> list[dict]:
    hidden, inter, experts, k = SHAPES[name]
    gen = torch.Generator(device).manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * inter ** -0.5
    kernels = ["grouped_mm", "gather"] + (["triton"] if device.type == "cuda" else [])
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, device=device, dtype=dtype, generator=gen)
        ids = torch.rand(t, experts, device=device, generator=gen).topk(k, dim=-1).indices
        weights = torch.rand(t, k, device=device, generator=gen).softmax(-1).to(dtype)
        touched = int(ids.unique().numel())
        floor = None if bandwidth is None else touched * 3 * hidden * inter * dtype.itemsize / bandwidth
        reference = expert_mlp(x, weights, ids, gate_up, down, silu_mul, "grouped_mm")
        for kernel in kernels:
            if kernel == "gather" and t > GATHER_MAX_TOKENS:
                continue
            for tiles in (TRITON_TILES if kernel == "triton" else [None]):
                def run(kernel=kernel, tiles=tiles):
                    return expert_mlp(x, weights, ids, gate_up, down, silu_mul, kernel, tiles)

                try:
                    diff = float((run().float() - reference.float()).abs().max())
                    seconds = timed(run, device, repeats)
                except Exception as e:  # a tile the compiler refuses (shared memory): recorded, the sweep goes on
                    rows.append(dict(shape=name, tokens=t, kernel=kernel, tiles=tiles, error=str(e)[:300]))
                    continue
                row = dict(shape=name, tokens=t, kernel=kernel, tiles=tiles, us=seconds * 1e6,
                           max_abs_diff_vs_grouped_mm=diff, experts_touched=touched)
                if floor is not None:
                    row.update(floor_us=floor * 1e6, floor_fraction=floor / seconds)
                rows.append(row)
                print(f"{name:<16}{t:>7}  {kernel:<11}{str(tiles or ''):<48}{seconds * 1e6:>10.1f} us"
                      + (f"  floor {floor * 1e6:8.1f} us ({floor / seconds:5.1%})" if floor else ""), flush=True)
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Per (shape, tokens): the fastest run of each kernel (the Triton one over its tiles)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["shape"], r["tokens"], r["kernel"])
        if "us" in r and (key not in out or r["us"] < out[key]["us"]):
            out[key] = r
    return list(out.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shapes", default=None, help="comma-separated SHAPES (default: both real ones on a GPU, toy "
                                                  "on a CPU)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = a.shapes.split(",") if a.shapes else (["qwen3-30b-a3b", "qwen3-moe-small"] if device.type == "cuda"
                                                   else ["toy"])
    tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else (GPU_TOKENS if device.type == "cuda"
                                                                           else (4, 32))
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = [r for name in shapes for r in bench_shape(name, tokens, device, dtype, bandwidth, a.repeats)]
    report = dict(commit=git_commit(), device=torch.cuda.get_device_name() if device.type == "cuda" else
                  platform.processor(), torch=torch.__version__, dtype=str(dtype), engine_tiles=TILES,
                  copy_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9, results=rows, best=best(rows))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        report.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / 2**30,
                      device_used_gb=(total - free) / 2**30)
    print(f"\n{'shape':<16}{'tokens':>7}  {'kernel':<11}{'us':>10}{'floor %':>9}")
    for r in report["best"]:
        print(f"{r['shape']:<16}{r['tokens']:>7}  {r['kernel']:<11}{r['us']:>10.1f}"
              f"{r.get('floor_fraction', 0) * 100:>8.1f}%  {r['tiles'] or ''}")
    write_json(report, a.out or f"bench/results/moe_kernels_{a.device}.json")


if __name__ == "__main__":
    main()
