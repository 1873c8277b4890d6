"""Triton kernels of the attention half of a decode step on CUDA: rotary + K/V cache write, and split-KV
attention of one query per row over its slot.

Over the slot cache (`kv_cache.py`: `[slots + 1, max_len, kv_heads, head_dim]` per layer) a decode step
of B rows has one new token per row. The general path for it (`attention.cache_attention`, flash's
varlen kernel with one query per row, plus `index_copy_` writes and contiguous copies of q) ran at 3.4×
its bandwidth floor on an H200 (docs/benchmarks.md, "Where a decode step's time goes"). Here:

- `rotary_store_(qkv, positions, cos, sin, k_cache, v_cache, write_index, heads, kv_heads)`: one kernel
  rotates the q and k heads of the fused projection output in place (`kernels.rope_halves`, as
  `kernels.rotary_` does) and stores each token's k and v heads at its flat cache position.
- `decode_attention(q, k_cache, v_cache, slots, context_lens, scale, splits)`: each program takes one
  row, one KV head with all the query heads that share it (the group is read from q where the
  projection left it, no copy), and one of `splits` pieces of the row's context, and runs an online
  softmax over it; with several pieces a second kernel merges them by their log-sum-exp (flash-
  decoding). The grid is fixed by the batch and `splits`, and each row's length is read on the device,
  so it runs inside the decode CUDA graphs.

`supported(head_dim)` says whether a shape can take these kernels (a power-of-two head dimension ≥ 16);
the caller keeps the general path otherwise, and on CPU.
"""

from __future__ import annotations

import torch

from hybridflow.engine.rollout.kernels import triton

if triton is not None:
    import triton.language as tl

    from hybridflow.engine.rollout.kernels import rope_halves

SPLIT_MIN = 256  # the fewest cached positions worth a piece of their own
# tiles of 4,096 K elements (64 positions at head_dim 64, 32 at 128) and 2 warps were the fastest of
# 32-128 positions x 2-4 warps on an H200 (`bench/rollout.py`'s decode attention sweep, docs/benchmarks.md)
TILE_ELEMENTS, WARPS = 4096, 2


def supported(head_dim: int) -> bool:
    return triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_splits(rows: int, kv_heads: int, max_len: int, multiprocessors: int) -> int:
    """Pieces each row's context is split into: one while the (row, KV head) programs alone fill the
    multiprocessors (one piece was fastest at 64 and 256 rows on an H200), else enough pieces to fill
    them, none shorter than SPLIT_MIN positions of a full slot (few rows over long contexts)."""
    return max(1, min(multiprocessors // (rows * kv_heads), max_len // SPLIT_MIN))


def block_for(head_dim: int) -> int:
    """Cached positions per loop iteration of an attention program."""
    return max(16, TILE_ELEMENTS // head_dim)


def rotary_store_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor, heads: int,
                  kv_heads: int) -> None:
    """qkv [T, (heads + 2 kv_heads) * D] (q heads, then k, then v): rotate q and k in place by positions [T]
    (cos/sin [max_len, D] fp32 tables) and write k and v to flat cache position write_index [T] of one
    layer's caches ([slots + 1, max_len, kv_heads, D])."""
    tokens = qkv.shape[0]
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    _rotary_store_kernel[(tokens,)](
        qkv, positions, cos, sin, k_cache, v_cache, write_index, qkv.stride(0), cos.stride(0), HEADS=heads,
        KV_HEADS=kv_heads, HALF=dim // 2, QK_PAD=triton.next_power_of_2(heads + kv_heads),
        KV_PAD=triton.next_power_of_2(kv_heads))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, splits: int, block: int | None = None,
                     warps: int = WARPS) -> torch.Tensor:
    """q [B, H, D] (any row stride, heads contiguous) over each row's slot's first context_lens positions
    -> [B, H, D] in q's dtype. k/v_cache [slots + 1, max_len, Hkv, D]; slots, context_lens [B]. `block`
    and `warps` are the kernel's tile (None: `block_for(D)`) and warp count (`bench/rollout.py` sweeps them)."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if q.stride()[1:] != (dim, 1) or k_cache.stride()[2:] != (dim, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"decode_attention reads heads of {dim} contiguous elements: q strides {q.stride()}, "
                         f"k/v cache strides {k_cache.stride()} / {v_cache.stride()}")
    group = heads // kv_heads
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        part_o = part_lse = out
    else:
        part_o = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, slots, context_lens, out, part_o, part_lse, q.stride(0), k_cache.stride(0),
        k_cache.stride(1), scale, HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=dim, SPLITS=splits, BLOCK=block or block_for(dim), num_warps=warps)
    if splits > 1:
        _merge_kernel[(rows * heads,)](part_o, part_lse, out, SPLITS=splits,
                                       SPLITS_PAD=triton.next_power_of_2(splits), D=dim)
    return out


if triton is not None:

    @triton.jit
    def _rotary_store_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, index_ptr, stride_t, stride_c,
                             HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                             QK_PAD: tl.constexpr, KV_PAD: tl.constexpr):
        t = tl.program_id(0)  # one program per token, all its heads
        pos = tl.load(pos_ptr + t)
        dest = tl.load(index_ptr + t).to(tl.int64) * (KV_HEADS * 2 * HALF)
        row = x_ptr + t * stride_t
        h = tl.arange(0, QK_PAD)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        qk = h < HEADS + KV_HEADS
        x1 = tl.load(row + h * 2 * HALF + offs, mask=qk).to(tl.float32)
        x2 = tl.load(row + h * 2 * HALF + HALF + offs, mask=qk).to(tl.float32)
        o1, o2 = rope_halves(x1, x2, x_ptr, cos_ptr, sin_ptr, pos, stride_c, offs, HALF)
        tl.store(row + h * 2 * HALF + offs, o1, mask=qk)
        tl.store(row + h * 2 * HALF + HALF + offs, o2, mask=qk)
        is_k = qk & (h >= HEADS)
        k_at = k_ptr + dest + (h - HEADS) * 2 * HALF + offs
        tl.store(k_at, o1, mask=is_k)
        tl.store(k_at + HALF, o2, mask=is_k)
        j = tl.arange(0, KV_PAD)[:, None]
        full = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(row + (HEADS + KV_HEADS + j) * 2 * HALF + full, mask=j < KV_HEADS)
        tl.store(v_ptr + dest + j * 2 * HALF + full, v, mask=j < KV_HEADS)

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, part_o_ptr, part_lse_ptr, stride_q,
                       stride_slot, stride_pos, scale, HEADS: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + row)
        piece = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK) * BLOCK
        start = split * piece
        end = tl.minimum(start + piece, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        in_group = g < GROUP
        head = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_q + head[:, None] * D + d[None, :], mask=in_group[:, None], other=0.0)
        cache = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + kv_head * D
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for first in range(start, end, BLOCK):
            n = first + tl.arange(0, BLOCK)
            valid = n < end
            at = cache + n[:, None].to(tl.int64) * stride_pos + d[None, :]
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - new_m)
            p = tl.exp(scores - new_m[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = new_m
        if SPLITS == 1:
            tl.store(out_ptr + (row * HEADS + head[:, None]) * D + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=in_group[:, None])
        else:  # an empty piece (a short row) stores a log-sum-exp of -inf: the merge gives it no weight
            done = total > 0
            at = (row * HEADS + head) * SPLITS + split
            tl.store(part_o_ptr + at[:, None] * D + d[None, :],
                     acc / tl.where(done, total, 1.0)[:, None], mask=in_group[:, None])
            tl.store(part_lse_ptr + at, tl.where(done, m + tl.log(total), float("-inf")), mask=in_group)

    @triton.jit
    def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                      D: tl.constexpr):
        row_head = tl.program_id(0)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D)
        lse = tl.load(part_lse_ptr + row_head * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, axis=0))
        o = tl.load(part_o_ptr + (row_head * SPLITS + s)[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None],
                    other=0.0)
        merged = tl.sum(weight[:, None] * o, axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + row_head * D + d, merged.to(out_ptr.dtype.element_ty))
