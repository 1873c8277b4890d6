"""The decode step's GEMMs alone: cuBLAS against cuBLASLt and a Triton GEMM's tiles, at the rollout's row counts.

    python bench/decode_gemm.py --device cuda            # one H200: about a minute
    TRITON_INTERPRET=1 python bench/decode_gemm.py --device cpu --check   # the Triton kernel's arithmetic only

A 0.5B decode step spends 43 % of its time in the layers' four GEMMs (q/k/v, o, gate/up, down) at about four
times the time their weights take to read (docs/benchmarks.md, the rollout profile). This measures each
projection of the Qwen2.5 0.5B and 1.5B shapes, and their LM head, at M = 64-512 rows, bf16, y = x @ W.T as
the rollout engine runs it (`F.linear`), inside a CUDA graph (as decode replays), with every layer's weights
distinct so that they stream from HBM rather than L2: per-GEMM microseconds, the HBM floor (weights, x and y
read or written once at `--hbm-tbs`) and the compute floor (at `--tflops`; the LM head at 256 rows is bound
by it). Backends: `cublas` and `cublaslt` (torch's preferred BLAS library) and a Triton GEMM at each tile
setting of `TILES` (the best per shape is reported with its tile). Prints a table and writes JSON (`--out`,
default bench/results/decode_gemm_<device>.json).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (hidden, q heads, kv heads, head dim, intermediate, layers)
SHAPES = {"0.5b": (896, 14, 2, 64, 4864, 24), "1.5b": (1536, 12, 2, 128, 8960, 28)}
VOCAB = 151936
HEAD_COPIES = 2  # the LM head runs once a step; two copies of its 272-465 MB weight already stream from HBM
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILES = [(m, n, k, 8 if m * n >= 16384 else 4, s)
         for m, n, k, s in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4))]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K].T, all row-major, fp32 accumulation, one output tile per program."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :], mask=(rn[:, None] < N) & ((k + rk)[None, :] < K),
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, tile: tuple) -> torch.Tensor:
    bm, bn, bk, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](x, w, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                           num_warps=warps, num_stages=stages)
    return y


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of y = x @ W.T: the layer's four projections and the LM head."""
    h, hq, hkv, d, inter, _ = SHAPES[shape]
    return {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * inter, h), "down": (h, inter),
            "lm_head": (VOCAB, h)}


def time_graph(fn, weights: list[torch.Tensor], x: torch.Tensor, reps: int = 20) -> float:
    """Microseconds per GEMM: one CUDA graph calling `fn` once per layer weight, replayed `reps` times."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def measure(shape: str, rows: list[int], hbm_tbs: float, tflops: float, tiles: list[tuple]) -> list[dict]:
    layers = SHAPES[shape][-1]
    out = []
    for name, (n, k) in projections(shape).items():
        copies = HEAD_COPIES if name == "lm_head" else layers
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor_us = 2 * (n * k + m * k + m * n) / (hbm_tbs * 1e12) * 1e6
            flop_floor_us = 2 * m * n * k / (tflops * 1e12) * 1e6
            rec = {"shape": shape, "proj": name, "M": m, "N": n, "K": k, "hbm_floor_us": floor_us,
                   "flop_floor_us": flop_floor_us}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                rec[library + "_us"] = time_graph(F.linear, weights, x)
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, weights[0]).float()
            best = None
            for tile in tiles:
                try:
                    got = triton_linear(x, weights[0], tile).float()
                    if not torch.allclose(got, ref, atol=2e-2, rtol=2e-2):
                        continue
                    us = time_graph(lambda a, b, t=tile: triton_linear(a, b, t), weights, x)
                except Exception:  # a tile that does not fit the shared memory
                    continue
                if best is None or us < best[0]:
                    best = (us, tile)
            rec["triton_us"], rec["triton_tile"] = best if best else (None, None)
            rec["best"] = min(("cublas", "cublaslt", "triton"), key=lambda b: rec[b + "_us"] or float("inf"))
            out.append(rec)
            print(f"{shape:<5}{name:<8}{m:>5}{n:>7}{k:>6}  floor {max(floor_us, flop_floor_us):6.2f}  "
                  f"cublas {rec['cublas_us']:6.2f}  "
                  f"cublaslt {rec['cublaslt_us']:6.2f}  triton {rec['triton_us'] or 0:6.2f} {rec['triton_tile']}",
                  flush=True)
        del weights
    return out


def check_cpu() -> None:
    """The Triton kernel against x @ W.T in Triton's interpreter (odd sizes: every mask is exercised)."""
    torch.manual_seed(0)
    x = torch.randn(37, 100)
    w = torch.randn(70, 100)
    got = triton_linear(x, w, (16, 32, 32, 4, 3))
    torch.testing.assert_close(got, x @ w.T, atol=1e-3, rtol=1e-3)
    print("triton gemm matches x @ W.T")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--check", action="store_true", help="on a CPU: only check the Triton kernel (interpreter)")
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--rows", default="64,128,256,512")
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8 TB/s)")
    p.add_argument("--tflops", type=float, default=783.0,
                   help="bf16 matmul rate for the compute floor (783: measured on an H200 by bench/train.py)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.device == "cpu":
        check_cpu()
        return
    from bench_util import git_commit, write_json

    rows = [int(r) for r in a.rows.split(",")]
    results = [r for s in a.shapes.split(",") for r in measure(s, rows, a.hbm_tbs, a.tflops, TILES)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": git_commit(), "hbm_tbs": a.hbm_tbs, "tflops": a.tflops, "tiles": TILES,
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "results": results}
    write_json(report, a.out or HERE / "results" / f"decode_gemm_{a.device}.json")


if __name__ == "__main__":
    main()
