"""4-bit frozen bases for LoRA (QLoRA, `model.quantization=nf4`): the frozen weight of each adapted linear layer
stored as torchao's 4-bit NormalFloat tensor (`NF4Tensor`: 64-value blocks, int8 block scales quantized again per
256; about 0.52 bytes a weight), applied in the training engine's model-building step after the adapters.

An `NF4Tensor` weight computes `F.linear` by dequantizing itself to the input's dtype (torchao's `linear_nf4`,
saving only the 4-bit weight for the backward); it never trains. `quantize_base` swaps them in, quantizing each
weight on the engine's device so no bf16 copy of the whole model reaches it; `dense` gives a weight back in a
plain dtype (the merged weights a rollout engine and `hybridflow export --merge` get are the dequantized base plus
the adapters: the policy the trainer computes with). `quantized_params` counts, on the meta device, what a run
stores in 4 bits (for device budgeting).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from hybridflow.config.schema import LoraConfig

BLOCK = 64  # values per scale (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # scales per second-level factor (torchao's default; smaller where a weight has fewer blocks)


def _torchao_nf4() -> tuple[Any, type]:
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError as e:
        raise ImportError("model.quantization=nf4 needs torchao: pip install 'hybridflow[memory]'") from e
    return to_nf4, NF4Tensor


def to_nf4(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` as an `NF4Tensor` (its dtype stays the weight's: what `dense` returns). Refuses a weight whose size
    is not a whole number of 64-value blocks, naming it."""
    if weight.numel() % BLOCK:
        raise ValueError(f"model.quantization=nf4: {name} has {weight.numel():,} values, not a multiple of the "
                         f"{BLOCK}-value NF4 block; leave that module out of lora.target_modules or use "
                         f"model.quantization=none")
    quantize, _ = _torchao_nf4()
    return quantize(weight, BLOCK, math.gcd(weight.numel() // BLOCK, SCALER_BLOCK))


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` is a 4-bit NormalFloat tensor (False without torchao: nothing can be one)."""
    try:
        from torchao.quantization import NF4Tensor
    except ImportError:
        return False
    return isinstance(t, NF4Tensor)


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` in its plain dtype: an `NF4Tensor` dequantized, any other tensor as it is."""
    return cast(Any, t).get_original_weight() if is_nf4(t) else t


@torch.no_grad()
def quantize_base(layers: dict[str, Any], device: torch.device) -> int:
    """Replaces the frozen `base_layer.weight` of each of peft's adapted linear `layers` (by name) with its 4-bit
    copy, made on `device`; returns how many weights it stores in 4 bits."""
    stored = 0
    for name, layer in layers.items():
        base = layer.base_layer
        weight = base.weight
        base.weight = torch.nn.Parameter(to_nf4(weight.detach().to(device), f"{name}.weight"), requires_grad=False)
        stored += weight.numel()
        del weight
    return stored


def quantized_params(config: Any, lora: LoraConfig, head: str = "lm", trust_remote_code: bool = False
                     ) -> tuple[int, int]:
    """(weights stored in 4 bits, the largest of them) of a LoRA run of `lora` with a 4-bit base on the model of
    Hugging Face `config` (`head`: ``lm`` or ``value``): the adapted linear layers' weights, counted on the meta
    device."""
    from hybridflow.engine.train.lora import meta_model, resolve_targets

    sizes = [m.weight.numel() for m in resolve_targets(meta_model(config, head, trust_remote_code),
                                                        list(lora.target_modules)).values()]
    return sum(sizes), max(sizes, default=0)
