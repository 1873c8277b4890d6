"""The invariant linear layer on CUDA: a Triton GEMM with no split-K, its tiling from a measured table.

y = x @ W.T (+ b). Each program owns one [BLOCK_M, BLOCK_N] tile of y and walks K from 0 in steps of
BLOCK_K, accumulating `tl.dot` in fp32, then adds the bias and rounds once. The tile sizes, warps and
stages come from `tiles.tile_for` by dtype, M, N and K. A tiling decides which program computes an output
element, not the order in which its K products are summed (the tensor cores' k16 steps from k = 0), so an
output element is a function of its row of x and its row of W alone, for one row or thirty thousand, for a
fused projection (q|k|v) or its parts; the table holds only tilings measured bit-equal to its per-K one
(`tiles.py` says how). cuBLAS picks its kernel, tile and split-K from the shape, which is what makes a
decode step's logits differ from the trainer's forward of the same token (Thinking Machines, "Defeating
nondeterminism in LLM inference", 2025). fp32 inputs multiply in IEEE fp32, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.invariant.tiles import Tile, tile_for

GROUP_M = 8  # tiles of M walked together for L2 reuse of W (the order of programs, not of arithmetic)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] (rows contiguous), bias [N] -> [M, N] in x's dtype. `tile`:
    another (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) than `tile_for`'s (bench/invariant_gemm.py measures them)."""
    rows, depth = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"invariant linear reads rows of contiguous elements: x strides {x.stride()}, weight "
                         f"strides {weight.stride()}")
    block_m, block_n, block_k, warps, stages = tile or tile_for(x.dtype, rows, n, depth)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _linear_kernel[grid](x, weight, weight if bias is None else bias, out, rows, n, depth, x.stride(0),
                         weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
                         PRECISION="ieee" if x.dtype == torch.float32 else None, num_warps=warps,
                         num_stages=stages)
    return out


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_at = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        a = tl.load(x_at, mask=(rows[:, None] < M) & (ks[None, :] < K - start), other=0.0)
        b = tl.load(w_at, mask=(cols[None, :] < N) & (ks[:, None] < K - start), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
