"""Packed (variable-length) causal attention for Hugging Face models.

Registers the attention implementation ``"hybridflow_varlen"`` with `transformers`' attention and
mask registries; the engine loads models with it. A call with rows concatenated into one sequence
`[1, T]` plus ``cu_seq_lens_q`` (int32 `[N+1]` row starts) and ``max_length_q`` keyword arguments (which
`transformers` forwards from the model call to every attention layer) runs packed attention, no row
attending across another; any other call (padded rows and their mask) runs plain SDPA. The choice is
made per call from the arguments, so recomputation under gradient checkpointing takes the same path.

On CUDA the packed kernel is `torch.nn.attention.varlen.varlen_attn` (flash attention over cumulative
lengths, no padding, no mask) for half-precision inputs; elsewhere, and for fp32 outside autocast, one
causal SDPA call per row.

A sliding-window layer (transformers passes its `sliding_window` W to the attention function: Gemma 3's local
layers, Mistral's) attends, packed, from each token to the W positions of its row ending at itself, as
transformers' `sliding_window_causal_mask_function` does on padded rows: flash's `window_size=(W - 1, 0)`, or a
banded mask on the rows longer than W.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

VARLEN_ATTENTION = "hybridflow_varlen"

_varlen_attn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch without the varlen module: the mask path serves
    _varlen_attn = None
_VARLEN_PARAMS = set() if _varlen_attn is None else set(inspect.signature(_varlen_attn).parameters)


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _flash_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q/k/v in a dtype flash takes (fp16/bf16), or None when there is none. Under autocast q and k arrive
    in fp32 although the projections ran in half precision: the models' rotary tables are fp32 and
    promote them. They take autocast's dtype, which is what the projections already rounded to."""
    half = (torch.float16, torch.bfloat16)
    if q.dtype in half and k.dtype in half and v.dtype in half:
        return q, k, v
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        if dtype in half:
            return q.to(dtype), k.to(dtype), v.to(dtype)
    return None


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float | None, window: int | None = None) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]` through the flash varlen kernel."""
    if _varlen_attn is None:
        raise RuntimeError("flash varlen attention needs torch.nn.attention.varlen, which this torch lacks")
    kwargs: dict = {"scale": scale}
    if window is not None:
        if "window_size" not in _VARLEN_PARAMS:
            raise RuntimeError(f"sliding_window={window} needs varlen_attn's window_size, which this torch lacks")
        kwargs["window_size"] = (window - 1, 0)
    elif "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
    out = _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return cast(torch.Tensor, out)  # without return_aux, the output alone


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A row's causal mask within the sliding window `[L, L]` (True: attend), None where plain causal serves."""
    if window is None or window >= length:
        return None
    steps = torch.arange(length, device=device)
    distance = steps[:, None] - steps[None, :]
    return (distance >= 0) & (distance < window)


def _looped_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                   scale: float | None, window: int | None = None) -> torch.Tensor:
    """Same contract as `_flash_varlen`, as one causal SDPA call per row: O(sum of L^2) work, where a
    block-diagonal mask over the whole pack would cost O(T^2) (seconds on a CPU for a few thousand tokens)."""
    bounds = cu.tolist()
    rows = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            mask = _window_mask(e - s, window, q.device)
            rows.append(F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(rows, dim=0) if rows else q.new_empty(q.shape)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The `transformers` attention-function contract: q `[B, Hq, T, D]`, k/v `[B, Hkv, T, D]` ->
    (`[B, T, Hq, D]`, None). Packed when ``cu_seq_lens_q`` and ``max_length_q`` are in `kwargs`."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention needs one row [1, T]; got a batch of {query.shape[0]} rows")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    # max_length_q passed through as it came (no int()): under torch.compile it is symbolic, and int() would
    # specialise the compiled layer on each micro-batch's longest row
    return packed_attention(q, k, v, cu, kwargs["max_length_q"], scaling,
                            kwargs.get("sliding_window")).unsqueeze(0), None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                     scale: float | None, window: int | None = None) -> torch.Tensor:
    """Causal attention of rows packed by `cu` (int32 `[N+1]` row starts), within the last `window` positions
    where given: q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]`; the flash varlen kernel where it applies
    (CUDA, half precision), else SDPA per row."""
    flash = _flash_dtype(q, k, v) if q.is_cuda and _varlen_attn is not None else None
    if flash is not None:
        return _flash_varlen(*flash, cu, max_len, scale, window)
    return _looped_varlen(q, k, v, cu, scale, window)


def _mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """SDPA's mask for padded rows; none for packed rows (their attention takes no mask)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    kwargs["attention_mask"] = attention_mask
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``"hybridflow_varlen"`` a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _mask)
