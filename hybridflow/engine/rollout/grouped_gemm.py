"""The routed experts' SwiGLU MLPs over a batch of tokens: each token's top-k (token, expert) pairs sorted by
expert and run as grouped GEMMs, with no host sync, so a decode step keeps it inside its CUDA graph.

`expert_mlp(x, weights, ids, gate_up, down, act, kernel)` -> the tokens' weighted sum of their experts' outputs.
Pair p = t * k + j is token t's j-th choice. Three kernels compute `pairs x gate_up[e]^T` and
`act(...) x down[e]^T`:
- "grouped_mm": `torch._grouped_mm` over the pairs sorted by expert, with per-expert row offsets (CPU in any
  float dtype, CUDA in bf16);
- "triton": `grouped_matmul`, a Triton grouped GEMM (CUDA): the sorted pairs are laid out in blocks of
  BLOCK_M rows, each expert's run padded to a whole number of blocks so a block has one expert
  (`block_layout`); the number of blocks is bounded by pairs + experts x (BLOCK_M - 1), a static grid
  whose unused blocks return at once, so it is capturable; the layout is counted and placed by two small
  Triton kernels (no sort); the kernel gathers each pair's input row itself and writes its output at the
  pair's own row, so nothing is permuted back, the down projection multiplying in the routing weight;
- "gather": a batched matmul over each pair's expert weights gathered (any device and dtype; memory grows
  with the pairs, for tests and fp32 on CUDA).
Outputs are rounded and weighted as Hugging Face's grouped_mm experts path does: each projection's output
in the model dtype, the routing weight multiplied in its own dtype (bf16 for Qwen, fp32 for Mixtral), the k
weighted outputs of a token summed, then cast back to the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

KERNELS = ("auto", "grouped_mm", "triton", "gather")


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """`kernel` with "auto" made concrete: on CUDA in bf16 the Triton kernel (on one H200 at fc3b0e2 it decoded
    the Qwen3-30B-A3B shape 1.09x faster than torch._grouped_mm at 256 rows; docs/moe.md), or grouped_mm
    where Triton is missing; grouped_mm on the CPU; else the gather fallback."""
    if kernel not in KERNELS:
        raise ValueError(f"moe_kernel={kernel!r} is invalid; valid: {', '.join(KERNELS)}")
    if kernel == "triton" and (triton is None or device.type != "cuda"):
        raise ValueError("moe_kernel='triton' needs a CUDA device and Triton")
    if kernel != "auto":
        return kernel
    if device.type == "cpu":
        return "grouped_mm"
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0):
        return "grouped_mm" if triton is None else "triton"
    return "gather"


def expert_mlp(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], kernel: str,
               tiles: dict[str, int] | None = None) -> torch.Tensor:
    """x [T, H]; weights [T, k] (model dtype or fp32) and ids [T, k] of each token's experts; gate_up
    [E, 2I, H], down [E, H, I]; act: [P, 2I] -> [P, I] (silu(gate) * up) -> [T, H] in x's dtype.
    tiles: the Triton kernel's block_m / block_n / block_k / num_warps / num_stages (default `TILES`)."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    if kernel == "triton":
        tiles = {**TILES, **(tiles or {})}
        block_m = tiles.pop("block_m")
        slot_pair, block_expert = block_layout(flat, gate_up.shape[0], block_m)
        hidden = grouped_matmul(x, gate_up, slot_pair, block_expert, k, None, **tiles)
        weighted = grouped_matmul(act(hidden), down, slot_pair, block_expert, 1, weights.reshape(-1), **tiles)
    else:
        order = torch.argsort(flat, stable=True)
        rows = x[order // k]
        if kernel == "grouped_mm":
            counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            offsets = counts.cumsum(0, dtype=torch.int32)
            sorted_out = torch._grouped_mm(act(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)),
                                           down.transpose(1, 2), offs=offsets)
        else:
            experts = flat[order]
            hidden = torch.bmm(gate_up[experts], rows[:, :, None])[..., 0]
            sorted_out = torch.bmm(down[experts], act(hidden)[:, :, None])[..., 0]
        out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        weighted = out * weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(1).to(x.dtype)


# the Triton kernel's tiles (pair rows, output columns and reduction per program; warps, pipeline stages);
# bench/moe_kernels.py sweeps them on the GPU
TILES = dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)


# pairs per program of the layout kernels (their one-hot tiles are LAYOUT_CHUNK x experts)
LAYOUT_CHUNK = 64


def block_layout(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's layout of P pairs (flat_ids [P], their experts): (slot_pair [S] int32, the pair in
    each slot (P: an empty slot), block_expert [S / block_m] int32, each block's expert (-1: unused)). Pairs are
    sorted by expert (stably) and each expert's run starts at a multiple of block_m; S = the bound
    P + E x (block_m - 1), rounded up to block_m, so the shapes depend only on P.

    Four launches, none of them a sort (one H200, 30B-A3B at batch 256: a radix argsort and ~20 index kernels
    took 1.4 ms and more of a 28 ms decode step, bench/results/moe_rollout_profile_h200_2cf5af7.json): each
    program counts its chunk's pairs per expert, a cumsum over the chunks gives each chunk's offset within an
    expert's run, and each program places its pairs at run start + chunk offset + rank within its chunk."""
    pairs, device = flat_ids.shape[0], flat_ids.device
    chunks = max(1, triton.cdiv(pairs, LAYOUT_CHUNK))  # no pairs: one program writes the empty layout
    experts = triton.next_power_of_2(num_experts)
    size = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    blocks = size // block_m
    counts = torch.empty(chunks, experts, dtype=torch.int32, device=device)
    _count_kernel[(chunks,)](flat_ids, counts, pairs, EXPERTS=experts, CHUNK=LAYOUT_CHUNK)
    through = counts.cumsum(0, dtype=torch.int32)
    slot_pair = torch.full((size,), pairs, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    per_program = triton.next_power_of_2(triton.cdiv(blocks, chunks))
    _place_kernel[(chunks,)](flat_ids, counts, through, slot_pair, block_expert, pairs, chunks, blocks,
                             EXPERTS=experts, CHUNK=LAYOUT_CHUNK, BLOCK_M=block_m, BLOCKS=per_program)
    return slot_pair, block_expert


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, slot_pair: torch.Tensor, block_expert: torch.Tensor,
                   top_k: int, scale: torch.Tensor | None = None, block_n: int = 64, block_k: int = 64,
                   num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """out[p] = a[p // top_k] @ w[expert of p]^T for every pair p of `block_layout`'s layout: a [rows, K], w
    [E, N, K] -> [P, N] in a's dtype, fp32 accumulation. top_k: pairs per row of `a` (1 when `a` is already
    one row per pair). scale [P]: each pair's routing weight, multiplied into its row as `out * scale[:, None]`
    would (the product rounded once, in the promoted dtype of a and scale), saving that pass."""
    num_pairs = a.shape[0] * top_k
    n, kdim = w.shape[1], w.shape[2]
    dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    out = torch.empty(num_pairs, n, dtype=dtype, device=a.device)
    block_m = slot_pair.shape[0] // block_expert.shape[0]
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_kernel[grid](a, w, out, slot_pair, block_expert, out if scale is None else scale, num_pairs, n, top_k,
                          a.stride(0), w.stride(0), w.stride(1), out.stride(0), KDIM=kdim, BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scale is not None, num_warps=num_warps,
                          num_stages=num_stages)
    return out


if triton is not None:

    @triton.jit
    def _grouped_kernel(a_ptr, w_ptr, out_ptr, slot_pair_ptr, block_expert_ptr, scale_ptr, num_pairs, n, top_k,
                        stride_a, stride_we, stride_wn, stride_out, KDIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
        """One BLOCK_M x BLOCK_N tile of one expert's pairs: rows gathered from `a` by pair // top_k, the
        expert's weight tile read once for the block, the tile stored at the pairs' own rows (the reduction
        length KDIM is a compile-time constant: a model has two, hidden and expert width); SCALED: rounded to
        a's dtype, then times each pair's scale."""
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:
            return
        pair = tl.load(slot_pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        row = tl.where(valid, pair // top_k, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        steps = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, KDIM, BLOCK_K):
            ks = start + steps
            a = tl.load(a_ptr + row[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < KDIM),
                        other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                        mask=(ks[:, None] < KDIM) & (cols[None, :] < n), other=0.0)
            acc = tl.dot(a, w, acc)
        result = acc.to(a_ptr.dtype.element_ty)
        if SCALED:
            weight = tl.load(scale_ptr + pair, mask=valid, other=0.0)
            result = result.to(tl.float32) * weight.to(tl.float32)[:, None]
        out = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, num_pairs, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """counts[chunk, e]: how many of this chunk's pairs chose expert e."""
        chunk = tl.program_id(0)
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        experts = tl.arange(0, EXPERTS)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(counts_ptr + chunk * EXPERTS + experts, tl.sum(hits, axis=0))

    @triton.jit
    def _place_kernel(ids_ptr, counts_ptr, through_ptr, slot_pair_ptr, block_expert_ptr, num_pairs, num_chunks,
                      num_blocks, EXPERTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCKS: tl.constexpr):
        """Writes this chunk's pairs into their slots and the experts of BLOCKS blocks. through[c, e] is the
        count of expert e's pairs in chunks 0..c; its last row, each expert's total, gives the runs (each padded
        to whole blocks, in expert order)."""
        chunk = tl.program_id(0)
        experts = tl.arange(0, EXPERTS)
        total = tl.load(through_ptr + (num_chunks - 1) * EXPERTS + experts)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        before = tl.load(through_ptr + chunk * EXPERTS + experts) - tl.load(counts_ptr + chunk * EXPERTS + experts)
        base = ends - padded + before
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = pair < num_pairs
        ids = tl.load(ids_ptr + pair, mask=valid, other=-1)
        hits = ids[:, None] == experts[None, :]
        # a pair's rank among the chunk's pairs of its expert: the running count of its expert's column
        running = tl.cumsum(hits.to(tl.int32), axis=0)
        slot = tl.sum(tl.where(hits, base[None, :] + running - 1, 0), axis=1)
        tl.store(slot_pair_ptr + slot, pair.to(tl.int32), mask=valid)
        block = chunk * BLOCKS + tl.arange(0, BLOCKS)
        start = block * BLOCK_M
        owner = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        used = start < tl.max(ends, axis=0)
        tl.store(block_expert_ptr + block, tl.where(used, owner, -1), mask=block < num_blocks)
