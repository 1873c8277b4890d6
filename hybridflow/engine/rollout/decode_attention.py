"""Triton kernels of the attention half of a decode step on CUDA: rotary + K/V cache write, and split-KV
attention of one query per row over its slot, apart or in one kernel.

Over the slot cache (`kv_cache.py`: `[slots + 1, max_len, kv_heads, head_dim]` per layer) a decode step
of B rows has one new token per row. The general path for it (`attention.cache_attention`, flash's
varlen kernel with one query per row, plus `index_copy_` writes and contiguous copies of q) ran far from
its bandwidth floor (the numbers: docs/benchmarks.md, "Where a decode step's time goes"). Here:

- `rotary_store_(qkv, positions, cos, sin, k_cache, v_cache, write_index, heads, kv_heads)`: one kernel
  rotates the q and k heads of the fused projection output in place (`kernels.rope`, as
  `kernels.rotary_` does) and stores each token's k and v heads at its flat cache position (prefill).
- `decode_attention(q, k_cache, v_cache, slots, context_lens, scale, splits)`: each program takes one
  row, one KV head with all the query heads that share it (the group is read from q where the
  projection left it, no copy), and one of `splits` pieces of the row's context, and runs an online
  softmax over it; with several pieces a second kernel merges them by their log-sum-exp (flash-
  decoding). The grid is fixed by the batch and `splits`, and each row's length is read on the device,
  so it runs inside the decode CUDA graphs.
- `rotary_decode_attention(qkv, cos, sin, k_cache, v_cache, slots, context_lens, scale, splits, heads)`:
  the decode step's usual path, both of the above in one kernel: each program rotates its q group and
  the row's new k in registers, the program whose piece holds the new position writes k and v to the
  cache, and the new token joins the online softmax from registers (so no program reads a cache entry
  written in the same kernel). One kernel fewer per layer.

With a sliding `window` (Gemma 3's local layers) the attention kernels read only each row's last `window`
positions, split into pieces as a whole context is.

`supported(head_dim)` says whether a shape can take these kernels (a power-of-two head dimension ≥ 16);
the caller keeps the general path otherwise, and on CPU.
"""

from __future__ import annotations

import torch

from hybridflow.engine.rollout.kernels import triton

if triton is not None:
    import triton.language as tl

    from hybridflow.engine.rollout.kernels import rope

SPLIT_MIN = 256  # the fewest cached positions worth a piece of their own
# tiles of 4,096 K elements (64 positions at head_dim 64, 32 at 128) and 2 warps were the fastest of
# 32-128 positions x 2-4 warps on an H200 (`bench/rollout.py`'s decode attention sweep, docs/benchmarks.md)
TILE_ELEMENTS, WARPS = 4096, 2


def supported(head_dim: int) -> bool:
    return triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_splits(rows: int, kv_heads: int, max_len: int, multiprocessors: int) -> int:
    """Pieces each row's context is split into: one while the (row, KV head) programs alone fill the
    multiprocessors (measured: docs/benchmarks.md, "Measurements behind choices"), else enough pieces to fill
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
        KV_HEADS=kv_heads, D=dim, QK_PAD=triton.next_power_of_2(heads + kv_heads),
        KV_PAD=triton.next_power_of_2(kv_heads))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, splits: int, block: int | None = None,
                     warps: int = WARPS, window: int | None = None) -> torch.Tensor:
    """q [B, H, D] (any row stride, heads contiguous) over each row's slot's first context_lens positions (the
    last `window` of them where given) -> [B, H, D] in q's dtype. k/v_cache [slots + 1, max_len, Hkv, D]; slots,
    context_lens [B]. `block` and `warps` are the kernel's tile (None: `block_for(D)`) and warp count
    (`bench/rollout.py` sweeps them)."""
    rows, heads, dim = q.shape
    if q.stride()[1:] != (dim, 1):
        raise ValueError(f"decode_attention reads heads of {dim} contiguous elements: q strides {q.stride()}")
    return _attend(q, None, k_cache, v_cache, slots, context_lens, scale, splits, heads, dim, block, warps, window)


def rotary_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            splits: int, heads: int, window: int | None = None,
                            rope_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention from the fused projection output qkv [B, (H + 2 Hkv) * D] as it left the
    GEMM: each row's token sits at position context_lens - 1; its q and k are rotated in registers (cos/sin
    [max_len, D] fp32 tables, any row stride), its k and v written to the slot's cache at that position, and its
    q attends over the cached positions before it (the last `window` - 1 where given) and over its own k and v
    -> [B, H, D]. One kernel does what `rotary_store_` and `decode_attention` do in two; qkv is left as it was.
    rope_offsets: [B] int64 added to each row's position for its rotation alone (a vision-language prompt's rope delta:
    `RunningBatch.rope_offsets`); the cache position stays context_lens - 1."""
    dim = qkv.shape[1] // (heads + 2 * k_cache.shape[2])
    if qkv.stride(1) != 1:
        raise ValueError(f"rotary_decode_attention reads rows of contiguous heads: qkv strides {qkv.stride()}")
    return _attend(qkv, (cos, sin), k_cache, v_cache, slots, context_lens, scale, splits, heads, dim, None, WARPS,
                   window, rope_offsets)


def _attend(q, rope_tables, k_cache, v_cache, slots, context_lens, scale, splits, heads, dim, block, warps,
            window, rope_offsets=None):
    """Both entry points' launch: q is a row-strided tensor whose rows start with the heads' queries (and,
    with rope_tables, continue with the new k and v heads)."""
    rows, kv_heads = q.shape[0], k_cache.shape[2]
    if k_cache.stride()[2:] != (dim, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"decode attention reads heads of {dim} contiguous elements: k/v cache strides "
                         f"{k_cache.stride()} / {v_cache.stride()}")
    group = heads // kv_heads
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        part_o = part_lse = out
    else:
        part_o = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    cos, sin = rope_tables or (q, q)  # unread without rotation
    offsets = rope_offsets if rope_offsets is not None else slots  # unread without offsets
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, slots, context_lens, out, part_o, part_lse, cos, sin, offsets, q.stride(0),
        k_cache.stride(0), k_cache.stride(1), cos.stride(0), scale, HEADS=heads, KV_HEADS=kv_heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, SPLITS=splits, BLOCK=block or block_for(dim),
        ROTATE=rope_tables is not None, SHIFT=rope_offsets is not None, WINDOW=window or 0, num_warps=warps)
    if splits > 1:
        _merge_kernel[(rows * heads,)](part_o, part_lse, out, SPLITS=splits,
                                       SPLITS_PAD=triton.next_power_of_2(splits), D=dim)
    return out


if triton is not None:

    @triton.jit
    def _rotary_store_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, index_ptr, stride_t, stride_c,
                             HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                             QK_PAD: tl.constexpr, KV_PAD: tl.constexpr):
        t = tl.program_id(0)  # one program per token, all its heads
        dest = tl.load(index_ptr + t).to(tl.int64) * (KV_HEADS * D)
        row = x_ptr + t * stride_t
        h = tl.arange(0, QK_PAD)[:, None]
        d = tl.arange(0, D)[None, :]
        qk = h < HEADS + KV_HEADS
        out = rope(row + h * D, d, cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_c, qk, D // 2)
        tl.debug_barrier()  # every thread has read its partner column before any column is overwritten
        tl.store(row + h * D + d, out, mask=qk)
        tl.store(k_ptr + dest + (h - HEADS) * D + d, out, mask=qk & (h >= HEADS))
        j = tl.arange(0, KV_PAD)[:, None]
        v = tl.load(row + (HEADS + KV_HEADS + j) * D + d, mask=j < KV_HEADS)
        tl.store(v_ptr + dest + j * D + d, v, mask=j < KV_HEADS)

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, part_o_ptr, part_lse_ptr, cos_ptr, sin_ptr,
                       offset_ptr, stride_q, stride_slot, stride_pos, stride_c, scale, HEADS: tl.constexpr,
                       KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr, SHIFT: tl.constexpr,
                       WINDOW: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + row)
        first_key = 0
        if WINDOW > 0:  # a sliding window's earliest position
            first_key = tl.maximum(length - WINDOW, 0)
        piece = tl.cdiv(tl.cdiv(length - first_key, SPLITS), BLOCK) * BLOCK
        start = first_key + split * piece
        end = tl.minimum(start + piece, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        in_group = g < GROUP
        head = kv_head * GROUP + g
        q_row = q_ptr + row * stride_q
        cache = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + kv_head * D
        if ROTATE:  # the row's new token (position length - 1) comes from the projection, not the cache
            pos = length - 1
            turn = pos  # the rotary position: the cache position, shifted by the row's offset where given
            if SHIFT:
                turn = pos + tl.load(offset_ptr + row).to(tl.int32)
            q = rope(q_row + head[:, None] * D, d[None, :], cos_ptr, sin_ptr, turn, stride_c, in_group[:, None],
                     D // 2)
            k_new = rope(q_row + (HEADS + kv_head) * D, d, cos_ptr, sin_ptr, turn, stride_c, d < D, D // 2)
            v_new = tl.load(q_row + (HEADS + KV_HEADS + kv_head) * D + d)
            owner = (pos >= start) & (pos < end)  # the one piece holding the new position writes it
            if owner:
                tl.store(k_ptr + cache + pos.to(tl.int64) * stride_pos + d, k_new)
                tl.store(v_ptr + cache + pos.to(tl.int64) * stride_pos + d, v_new)
            end = tl.minimum(end, pos)
        else:
            q = tl.load(q_row + head[:, None] * D + d[None, :], mask=in_group[:, None], other=0.0)
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
        if ROTATE:
            if owner:  # fold the new token in as one more position of the online softmax
                score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
                new_m = tl.maximum(m, score)
                alpha = tl.exp(m - new_m)
                p = tl.exp(score - new_m)
                total = total * alpha + p
                # rounded to the cache's dtype as the loop's p is before its dot with v
                acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
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
