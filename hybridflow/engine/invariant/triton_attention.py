"""Invariant causal attention on CUDA: every query sums its keys in one fixed order, in Triton.

A query at position p of a sequence attends over the sequence's keys 0..p, which lie at `k_start + j`
of a key store (the packed keys of a training forward, or a slot of the rollout's KV cache flattened).
Each program takes one KV head and a tile of ROWS query rows (a query token times one of the query heads
sharing the KV head: `PER_TILE = ROWS / group` tokens of one sequence), and walks the keys from 0 in
blocks of KEYS positions with an online softmax. The tile shape, the key block and the launch settings
are constants, so the same tensor-core instruction computes every score and every weighted sum, and a
query's blocks are the same whether its tile holds one query (a decode step), several (a prefill), or the
trainer's packed row; a block past the query's own position is masked out entirely and leaves its running
max, sum and output exactly as they were (the rescale factor is 1 by construction, not by `exp(0)`).
There is no split of the keys over programs (flash-decoding), whose merge order would depend on the batch.

Which tile a program takes comes from a table built on the device from the query counts (`tiles`), so a
decode step runs inside a CUDA graph and a forward builds the table once for all its layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # (query token, head) rows per program: the M of every tl.dot
KEYS = 64  # key positions per block: the order every query sums its keys in
WARPS = 4


def per_tile(heads: int, kv_heads: int) -> int:
    """Query tokens per tile: ROWS over the query heads of one KV head (padded to a power of two)."""
    group = triton.next_power_of_2(heads // kv_heads)
    if group > ROWS:
        raise ValueError(f"invariant attention takes at most {ROWS} query heads per KV head, got {heads // kv_heads}")
    return ROWS // group


def tiles(q_starts: torch.Tensor, queries: int, tokens_per_tile: int) -> torch.Tensor:
    """[2, n] int32 (sequence, first query) of each tile, sequence S for programs with no tile; q_starts
    [S + 1] int32 on the device; `queries` the total count (q_starts[-1]) as a host int. No host sync."""
    sequences = q_starts.shape[0] - 1
    n = queries // tokens_per_tile + sequences
    counts = (q_starts[1:] - q_starts[:-1]).long()
    per_seq = (counts + tokens_per_tile - 1) // tokens_per_tile
    ends = per_seq.cumsum(0)
    ids = torch.arange(n, device=q_starts.device)
    seq = torch.searchsorted(ends, ids, right=True)
    first = (ids - (ends - per_seq)[seq.clamp(max=max(sequences - 1, 0))]) * tokens_per_tile
    return torch.stack([seq, first]).to(torch.int32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: torch.Tensor, k_starts: torch.Tensor,
              lengths: torch.Tensor, scale: float, table: torch.Tensor) -> torch.Tensor:
    """See `ops.attention`; `table` from `tiles`."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if q.stride()[1:] != (dim, 1) or k.stride()[1:] != (dim, 1) or v.stride()[1:] != (dim, 1) \
            or dim & (dim - 1) or dim < 16:
        raise ValueError(f"invariant attention needs a power-of-two head dim >= 16 and contiguous heads: q "
                         f"{tuple(q.shape)} strides {q.stride()}, k strides {k.stride()}, v strides {v.stride()}")
    group = heads // kv_heads
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens:
        _attention_kernel[(table.shape[1], kv_heads)](
            q, k, v, out, table, q_starts, k_starts, lengths, q.stride(0), k.stride(0), v.stride(0), scale,
            q_starts.shape[0] - 1, table.stride(0), HEADS=heads, GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group), PER_TILE=ROWS // triton.next_power_of_2(group), D=dim,
            ROWS=ROWS, KEYS=KEYS, PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=WARPS,
            num_stages=2)
    return out


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, q_start_ptr, k_start_ptr, len_ptr, stride_q, stride_k,
                      stride_v, scale, sequences, stride_table, HEADS: tl.constexpr, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, PER_TILE: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                      KEYS: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(table_ptr + tile)
    if seq < sequences:
        first = tl.load(table_ptr + stride_table + tile)
        q_first = tl.load(q_start_ptr + seq)
        count = tl.load(q_start_ptr + seq + 1) - q_first
        key0 = tl.load(k_start_ptr + seq).to(tl.int64)
        length = tl.load(len_ptr + seq)
        r = tl.arange(0, ROWS)
        query = first + r // GROUP_PAD
        g = r % GROUP_PAD
        valid = (query < count) & (g < GROUP)
        position = length - count + tl.minimum(query, count - 1)  # padding rows take a real query's
        head = kv_head * GROUP + g
        d = tl.arange(0, D)
        q_rows = (q_first + query).to(tl.int64) * stride_q + head * D
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        end = length - count + tl.minimum(first + PER_TILE, count)  # keys [0, end) cover the tile's queries
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for start in range(0, end, KEYS):
            n = start + tl.arange(0, KEYS)
            at = key0 + n.to(tl.int64)
            k = tl.load(k_ptr + at[:, None] * stride_k + kv_head * D + d[None, :], mask=(n < end)[:, None],
                        other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(n[None, :] <= position[:, None], scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.where(new_m == m, 1.0, tl.exp(m - new_m))
            p = tl.exp(scores - new_m[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + at[:, None] * stride_v + kv_head * D + d[None, :], mask=(n < end)[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = new_m
        o_rows = (q_first + query).to(tl.int64) * (HEADS * D) + head * D
        tl.store(o_ptr + o_rows[:, None] + d[None, :], (acc / total[:, None]).to(o_ptr.dtype.element_ty),
                 mask=valid[:, None])
