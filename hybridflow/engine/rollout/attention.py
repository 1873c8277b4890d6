"""Attention over packed tokens and the slot KV cache: cache writes, varlen prefill, and decode.

Two kernels per phase, picked by `Backend`:
- "flash" (CUDA, bf16/fp16): `aten._flash_attention_forward`, varlen with `cu_seqlens` for packed
  prefill; for decode, the slot cache flattened to `[slots * max_len, kv_heads, head_dim]` with
  `cu_seqlens_k[b] = slot_b * max_len` and `seqused_k[b]` = the row's context length. Static shapes, so
  it runs inside CUDA graphs.
- "sdpa" (CPU, or fp32 on CUDA): `scaled_dot_product_attention` once over the prompts padded to the
  longest (causal and padding mask; per prompt when that would be large) for prefill, and over the
  slot rows (a view when the rows' slots are contiguous) with a length mask for decode.

Shapes: T packed tokens, B decode rows, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    """Per-forward attention inputs shared by all layers.

    prefill: packed prompts (causal within each) if True, else one new token per decode row.
    write_index: [T * n] flat cache positions (slot * max_len + position) the new K/V go to; in prefill
        each token is written to its prompt's n sample slots (token-major order).
    n: copies of each prefill token written (the samples per prompt); 1 in decode.
    cu_seqlens: prefill [S + 1] int32 prompt starts in the packed tokens; decode [B + 1] int32 row
        starts in the flattened cache (slot * max_len).
    cu_seqlens_q: decode [B + 1] int32, 0..B (one query per row).
    seqlens: prefill, the prompt lengths as Python ints (for the SDPA loop).
    max_seqlen: prefill, the longest prompt; decode, the largest context any row may have.
    context_lens: decode [B] int32, each row's context length including the new token.
    slots: decode [B] int64, each row's slot.
    padding: the SDPA layout (prefill: padded prompts; decode: rows and mask), made by the first layer.
    """

    prefill: bool
    write_index: torch.Tensor
    n: int = 1
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    seqlens: list[int] | None = None
    max_seqlen: int = 0
    context_lens: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    padding: tuple | None = None


def pick_backend(device: torch.device, dtype: torch.dtype) -> str:
    """'flash' on CUDA in half precision, else 'sdpa'."""
    return "flash" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMeta) -> None:
    """Store new K/V ([T, Hkv, D]) into one layer's cache ([slots + 1, max_len, Hkv, D]) in place."""
    if meta.n > 1:
        k, v = k.repeat_interleave(meta.n, dim=0), v.repeat_interleave(meta.n, dim=0)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.write_index, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.write_index, v)


_PADDED_LIMIT = 2**24  # prompts x longest^2 up to which SDPA prefill runs once over padded prompts


def _padding(meta: AttnMeta, tokens: int, device: torch.device):
    """Once per forward: gather index [S, L] from packed tokens to padded prompts, the valid positions
    [S, L], and the causal mask over valid keys [S, 1, L, L] (L = longest prompt)."""
    if meta.padding is None:
        steps = torch.arange(meta.max_seqlen, device=device)
        valid = steps[None, :] < torch.tensor(meta.seqlens, device=device)[:, None]
        index = (meta.cu_seqlens[:-1, None].long() + steps[None, :]).clamp(max=tokens - 1)
        causal = steps[:, None] >= steps[None, :]
        meta.padding = (index, valid, (causal[None] & valid[:, None, :])[:, None])
    return meta.padding


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale: float,
                      backend: str) -> torch.Tensor:
    """Causal attention within each packed prompt. q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    if backend == "flash":
        return torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, 0.0, True, False,
            scale=scale)[0]
    if len(meta.seqlens) * meta.max_seqlen ** 2 <= _PADDED_LIMIT:
        index, valid, mask = _padding(meta, q.shape[0], q.device)
        out = F.scaled_dot_product_attention(q[index].transpose(1, 2), k[index].transpose(1, 2),
                                             v[index].transpose(1, 2), attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)[valid]
    outs = []
    for qs, ks, vs in zip(q.split(meta.seqlens), k.split(meta.seqlens), v.split(meta.seqlens)):
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                           vs.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                     scale: float, backend: str) -> torch.Tensor:
    """One query per row over its slot's first context_lens positions. q [B, H, D] -> [B, H, D]."""
    if backend == "flash":
        return torch.ops.aten._flash_attention_forward(
            q, k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]), meta.cu_seqlens_q,
            meta.cu_seqlens, 1, meta.max_seqlen, 0.0, False, False, scale=scale,
            seqused_k=meta.context_lens)[0]
    rows, mask = _decode_layout(meta)
    keys = k_cache[rows, :meta.max_seqlen].transpose(1, 2)
    values = v_cache[rows, :meta.max_seqlen].transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


def _decode_layout(meta: AttnMeta):
    """Once per step: the cache rows to read (a slice when the sorted slots are contiguous, on CPU, so
    no gather) and the length mask [B, 1, 1, max_seqlen]."""
    if meta.padding is None:
        rows = meta.slots
        if not rows.is_cuda:
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.shape[0]:
                rows = slice(first, last + 1)
        steps = torch.arange(meta.max_seqlen, device=meta.slots.device)
        meta.padding = (rows, (steps[None, :] < meta.context_lens[:, None])[:, None, None])
    return meta.padding
