"""Attention over packed tokens and the slot KV cache: cache writes, varlen prefill, and cache reads.

Two kinds of attention, each with two kernels picked by `Backend`:
- prefill of new prompts (`prefill_attention`): causal within each packed prompt, over its own K/V.
- attention over the cache (`cache_attention`): each row's newest tokens (one per row in decode; the
  appended tokens of a continued sequence in a continuation prefill) attend to everything in the row's
  slot up to themselves, the cached prefix included; their K/V are written to the slot first.

- "flash" (CUDA, bf16/fp16): `aten._flash_attention_forward`, varlen with `cu_seqlens` for packed
  prefill. In decode (one query per row) the split-KV Triton kernel of `decode_attention.py` reads the
  slots directly. Over the cache otherwise (a continuation prefill), flash with the slot cache flattened
  to `[slots * max_len, kv_heads, head_dim]`, `cu_seqlens_k[b] = slot_b * max_len`, `seqused_k[b]` = the
  row's context length and the causal mask aligned to the bottom right (query i of q_b sits at position
  context_b - q_b + i). Decode shapes are static, so it runs inside CUDA graphs.
- "sdpa" (CPU, or fp32 on CUDA): `scaled_dot_product_attention` once over the prompts padded to the
  longest (causal and padding mask; per prompt when that would be large) for prefill, and over the
  slot rows (a view when the rows' slots are contiguous) with a causal length mask over the cache.
- "exact" (`rollout.exact`, any device): every forward attends over the cache (`exact_attention`), with
  the invariant kernel the training engine's forward runs (`hybridflow.engine.invariant`).

A sliding-window layer (Gemma 3's local layers: `window` W) attends, from a query at position p, to the keys at
positions p - W + 1 .. p only (transformers' `sliding_window_causal_mask_function`); the cache keeps every
position and the attention leaves out what lies before the window: flash's `window_size_left = W - 1`, the decode
kernels' first position, and SDPA's masks narrowed once per forward per window (`AttnMeta.windowed`).

Shapes: T packed tokens, B decode rows, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant
from hybridflow.engine.rollout import decode_attention

_T = TypeVar("_T")


@dataclass
class AttnMeta:
    """Per-forward attention inputs shared by all layers.

    write_index: [W] flat cache positions (slot * max_len + position) the new K/V go to; in prefill
        a new prompt's tokens are written to each of its n sample slots.
    write_rows: [W] the packed token each write takes (None: token i -> write i).
    cu_seqlens: new-prompt prefill [S + 1] int32 prompt starts in the packed tokens; over the cache,
        [B + 1] int32 row starts in the flattened cache (slot * max_len).
    cu_seqlens_q: over the cache, [B + 1] int32 starts of each row's queries in the packed tokens.
    max_seqlen_q: over the cache, the most queries any row has (1 in decode).
    seqlens: new-prompt prefill, the prompt lengths as Python ints (for the SDPA loop).
    max_seqlen: new-prompt prefill, the longest prompt; over the cache, the largest context any row may have.
    context_lens: over the cache, [B] int32 each row's context length including its new tokens (None:
        a new-prompt prefill, which attends over its own K/V only).
    slots: over the cache, [B] int64 each row's slot.
    padding: the backend's layout, made by the first layer (SDPA prefill: padded prompts; SDPA over the
        cache: rows, queries, mask and query positions; exact: each row's first cache row and the kernel's work
        table).
    windowed: SDPA's masks narrowed to a sliding window, by window, made by the first layer of that window.
    live: decode, [B] bool the rows that have not finished (a hybrid model's recurrent states take in only
        their tokens: `recurrent_state.py`); None: every row.
    rope_offsets: decode, [B] int64 added to the rows' cache positions for their rotary embedding alone
        (`RunningBatch.rope_offsets`: the fused decode kernel rotates at context_lens - 1 + offset); None: no offset.
    """

    write_index: torch.Tensor
    write_rows: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1
    seqlens: list[int] | None = None
    max_seqlen: int = 0
    context_lens: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    padding: tuple | None = None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)
    live: torch.Tensor | None = None
    rope_offsets: torch.Tensor | None = None

    @property
    def reads_cache(self) -> bool:
        """True when the queries attend over the slot cache (decode, continuation prefill)."""
        return self.context_lens is not None


def _needed(value: _T | None, field: str) -> _T:
    """AttnMeta's `field`, which the attention being run cannot do without."""
    if value is None:
        raise ValueError(f"AttnMeta.{field} is None but this attention needs it: a new-prompt prefill's meta sets "
                         f"cu_seqlens and seqlens, one over the cache sets slots, context_lens and cu_seqlens_q")
    return value


def pick_backend(device: torch.device, dtype: torch.dtype, exact: bool = False) -> str:
    """'exact' when asked; else 'flash' on CUDA in half precision, else 'sdpa'."""
    if exact:
        return "exact"
    return "flash" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMeta) -> None:
    """Store new K/V ([T, Hkv, D]) into one layer's cache ([slots + 1, max_len, Hkv, D]) in place."""
    if meta.write_rows is not None:
        k, v = k[meta.write_rows], v[meta.write_rows]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.write_index, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.write_index, v)


_PADDED_LIMIT = 2**24  # prompts x longest^2 up to which SDPA prefill runs once over padded prompts


def _padding(meta: AttnMeta, tokens: int, device: torch.device):
    """Once per forward: gather index [S, L] from packed tokens to padded prompts, the valid positions
    [S, L], and the causal mask over valid keys [S, 1, L, L] (L = longest prompt)."""
    if meta.padding is None:
        steps = torch.arange(meta.max_seqlen, device=device)
        valid = steps[None, :] < torch.tensor(meta.seqlens, device=device)[:, None]
        index = (_needed(meta.cu_seqlens, "cu_seqlens")[:-1, None].long() + steps[None, :]).clamp(max=tokens - 1)
        causal = steps[:, None] >= steps[None, :]
        meta.padding = (index, valid, (causal[None] & valid[:, None, :])[:, None])
    return meta.padding


def _band(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Which keys (positions `keys`, broadcast against `queries`' positions) lie within the query's sliding
    window: p - window < key (None without a window)."""
    return None if window is None else keys > queries - window


def _windowed(meta: AttnMeta, mask: torch.Tensor, window: int | None, band) -> torch.Tensor:
    """The layout's mask, narrowed by `band(window)` where the layer has a window (once per forward per window)."""
    if window is None:
        return mask
    if window not in meta.windowed:
        meta.windowed[window] = mask & band(window)
    return meta.windowed[window]


def _flash_window(window: int | None) -> dict:
    """Flash's window arguments: the window's earlier keys and none after (causal)."""
    return {} if window is None else dict(window_size_left=window - 1, window_size_right=0)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale: float,
                      backend: str, window: int | None = None) -> torch.Tensor:
    """Causal attention within each packed prompt (within the last `window` positions where given). q [T, H, D],
    k/v [T, Hkv, D] -> [T, H, D]."""
    if backend == "flash":
        return torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, 0.0, True, False,
            scale=scale, **_flash_window(window))[0]
    if len(_needed(meta.seqlens, "seqlens")) * meta.max_seqlen ** 2 <= _PADDED_LIMIT:
        index, valid, mask = _padding(meta, q.shape[0], q.device)
        steps = torch.arange(meta.max_seqlen, device=q.device)
        mask = _windowed(meta, mask, window, lambda w: _band(steps[:, None], steps[None, :], w))
        out = F.scaled_dot_product_attention(q[index].transpose(1, 2), k[index].transpose(1, 2),
                                             v[index].transpose(1, 2), attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)[valid]
    outs = []
    for qs, ks, vs in zip(q.split(meta.seqlens), k.split(meta.seqlens), v.split(meta.seqlens)):
        steps = torch.arange(qs.shape[0], device=q.device)
        band = _band(steps[:, None], steps[None, :], window if window and window < qs.shape[0] else None)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                           vs.transpose(0, 1)[None], is_causal=band is None,
                                           attn_mask=None if band is None else band & (steps[:, None] >= steps),
                                           scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    scale: float, backend: str, window: int | None = None) -> torch.Tensor:
    """Each row's queries (packed by `cu_seqlens_q`; one per row in decode) over its slot's first
    context_lens positions, causally (within the last `window` positions where given): the last query of a row
    sees the whole context. q [T, H, D] -> [T, H, D]."""
    if decodes_in_triton(meta, backend, q.shape[-1]):
        return decode_attention.decode_attention(q, k_cache, v_cache, _needed(meta.slots, "slots"),
                                                 _needed(meta.context_lens, "context_lens"), scale,
                                                 _splits(q.shape[0], k_cache, meta), window=window)
    if backend == "flash":  # one query per row is causal too: its window reaches back from the row's end
        return torch.ops.aten._flash_attention_forward(
            q, k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]), meta.cu_seqlens_q,
            meta.cu_seqlens, meta.max_seqlen_q, meta.max_seqlen, 0.0, meta.max_seqlen_q > 1 or window is not None,
            False, scale=scale, seqused_k=meta.context_lens, **_flash_window(window))[0]
    rows, query_index, valid, mask, position = _cache_layout(meta)
    key_positions = torch.arange(meta.max_seqlen, device=q.device)
    mask = _windowed(meta, mask, window, lambda w: _band(position[:, None, :, None], key_positions, w))
    keys = k_cache[rows, :meta.max_seqlen].transpose(1, 2)
    values = v_cache[rows, :meta.max_seqlen].transpose(1, 2)
    queries = q[:, :, None] if query_index is None else q[query_index].transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0] if query_index is None else out.transpose(1, 2)[valid]


def exact_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    scale: float) -> torch.Tensor:
    """The exact backend: each row's queries (packed by `cu_seqlens_q`) over its slot's first context_lens
    positions, where their own K/V were just written, by `invariant.attention`. q [T, H, D] -> [T, H, D]."""
    max_len, kv_heads, dim = k_cache.shape[1:]
    q_starts = _needed(meta.cu_seqlens_q, "cu_seqlens_q")
    if meta.padding is None:
        meta.padding = (_needed(meta.slots, "slots") * max_len,
                        invariant.attention_table(q_starts, q.shape[0], q.shape[1], kv_heads))
    starts, table = meta.padding
    return invariant.attention(q, k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim),
                               q_starts, starts, _needed(meta.context_lens, "context_lens"), scale, table)


def decodes_in_triton(meta: AttnMeta, backend: str, head_dim: int) -> bool:
    """Whether attention over the cache runs `decode_attention.py`'s kernels: one query per row (decode),
    flash backend (CUDA, half precision), a head dim they support."""
    return (backend == "flash" and meta.reads_cache and meta.max_seqlen_q == 1
            and decode_attention.supported(head_dim))


def rotary_decode_attention(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttnMeta, heads: int, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """A decode step (one token per row) from the fused projection output qkv [B, (H + 2 Hkv) * D] as
    projected: rotary, the cache write and the attention (over the last `window` positions where given) in one
    kernel (`decode_attention`'s `rotary_decode_attention`; CUDA, a power-of-two head dim) -> [B, H, D]."""
    return decode_attention.rotary_decode_attention(qkv, *rope, k_cache, v_cache, _needed(meta.slots, "slots"),
                                                    _needed(meta.context_lens, "context_lens"), scale,
                                                    _splits(qkv.shape[0], k_cache, meta), heads, window,
                                                    meta.rope_offsets)


def _splits(rows: int, k_cache: torch.Tensor, meta: AttnMeta) -> int:
    return decode_attention.decode_splits(rows, k_cache.shape[2], meta.max_seqlen, _multiprocessors(k_cache.device))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cache_layout(meta: AttnMeta):
    """Once per forward: the cache rows to read (a slice when the sorted slots are contiguous, on CPU, so
    no gather), the gather index [B, Q] from packed queries to padded ones and their valid entries [B, Q]
    (both None in decode, one query per row), the causal length mask [B, 1, Q, max_seqlen] and each query's
    position [B, Q]."""
    if meta.padding is None:
        slots = _needed(meta.slots, "slots")
        rows: torch.Tensor | slice = slots
        if not slots.is_cuda:
            first, last = int(slots[0]), int(slots[-1])
            if last - first + 1 == slots.shape[0]:
                rows = slice(first, last + 1)
        keys = torch.arange(meta.max_seqlen, device=slots.device)
        context = _needed(meta.context_lens, "context_lens").long()
        if meta.max_seqlen_q == 1:
            query_index = valid = None
            mask = (keys[None, :] < context[:, None])[:, None, None]
            position = context[:, None] - 1
        else:
            steps = torch.arange(meta.max_seqlen_q, device=slots.device)
            q_starts = _needed(meta.cu_seqlens_q, "cu_seqlens_q")
            starts, counts = q_starts[:-1].long(), q_starts.diff().long()
            valid = steps[None, :] < counts[:, None]
            query_index = (starts[:, None] + steps[None, :]).clamp(max=int(q_starts[-1]) - 1)
            position = (context - counts)[:, None] + steps[None, :]  # each query's position in its row
            mask = ((keys[None, None, :] <= position[:, :, None]) & (keys[None, None, :] < context[:, None, None]))
            mask = mask[:, None]
        meta.padding = (rows, query_index, valid, mask, position)
    return meta.padding
