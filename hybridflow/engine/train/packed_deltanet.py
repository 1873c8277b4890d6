"""Packed rows through a hybrid model's linear-attention layers: each sequence's recurrent state starts at zero.

The training engine packs several sequences into one row `[1, T]` and marks their starts with `cu_seq_lens_q`
(`packing.py`); attention layers keep them apart by varlen attention (`attention.py`). A Gated DeltaNet layer
(Qwen3.5's and Qwen3-Next's `linear_attn`) carries a short-conv and a recurrent state along the row instead, which
must restart at each sequence. transformers' own layer cannot: on CPU it refuses `cu_seqlens` without
flash-linear-attention, and its short conv runs over the whole row either way. `install_packed_deltanet` gives each such layer a forward that,
for packed rows, runs the same mixer through `engine.linear_attention` with the row's boundaries (fla's kernels over
`cu_seqlens` on CUDA, a loop over the sequences elsewhere); padded rows keep transformers' forward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.engine.linear_attention import packed_mixer
from hybridflow.engine.train.kernels import keep_patched_forwards

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# transformers' Gated DeltaNet layers whose parameters and maths `linear_attention.packed_mixer` runs
DELTANET_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3NextGatedDeltaNet")


def _forward(layer: torch.nn.Module, hf_forward: Any, hidden_states: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return hf_forward(hidden_states, *args, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"packed rows come as one row [1, T]; got a batch of {hidden_states.shape[0]}")
    return packed_mixer(layer, hidden_states[0], cu)[0][None]


def install_packed_deltanet(model: PreTrainedModel) -> int:
    """Give every Gated DeltaNet layer of `model` the packed forward (for good: `kernels.keep_patched_forwards`);
    returns how many layers it patched."""
    keep_patched_forwards(model)
    layers = [m for m in model.modules() if type(m).__name__ in DELTANET_CLASSES]
    for layer in layers:
        layer.forward = functools.partial(_forward, layer, layer.forward)  # type: ignore[method-assign]
    return len(layers)
