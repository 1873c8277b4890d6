"""Swapping slow Hugging Face building blocks for fused PyTorch kernels, outside the model code.

`fuse_rms_norms(model)` points the forward of every standard RMSNorm (Qwen2/Qwen3/Llama/Mistral: weight x
normalised input, no offset) at `torch.nn.functional.rms_norm`, one fused kernel forward and backward on
CUDA instead of HF's seven elementwise passes in fp32. Same maths; the product with the weight is taken
in fp32 before the single rounding, where HF rounds the normalised input first.

`keep_patched_forwards(model)` turns transformers' hub kernels off first (they are on by default wherever the
`kernels` package is installed): with them on, every `train()` / `eval()` that changes the mode kernelizes the
model again, which puts the layers' class forwards back over forwards patched on the instances, here and in
exact mode (`hybridflow.engine.train.exact`).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STANDARD_RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


def keep_patched_forwards(model: PreTrainedModel) -> None:
    """Turn off transformers' hub kernels on `model` (see the module docstring), so forwards patched on its
    modules stay through `train()` / `eval()`."""
    if getattr(model, "use_kernels", False):
        model.use_kernels = False


def fuse_rms_norms(model: PreTrainedModel) -> int:
    """Patch the RMSNorm modules of `model` in place (for good: `keep_patched_forwards`); returns how many were
    patched."""
    keep_patched_forwards(model)
    count = 0
    for module in model.modules():
        if type(module).__name__ in STANDARD_RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
            count += 1
    return count
