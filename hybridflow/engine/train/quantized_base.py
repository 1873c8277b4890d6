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

from hybridflow.config.model_schema import LoraConfig

BLOCK = 64  # values per scale (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # scales per second-level factor (torchao's default; smaller where a weight has fewer blocks)


def _torchao_to_nf4() -> Any:
    try:
        from torchao.quantization import to_nf4
    except ImportError as e:
        raise ImportError("model.quantization=nf4 needs torchao: pip install 'hybridflow[memory]'") from e
    return to_nf4


def _scaler_block(blocks: int, shards: int) -> int | None:
    """The most scales (at most `SCALER_BLOCK`) per second-level factor that divides a weight's `blocks` into a
    number of factors FSDP2 can cut into `shards` equal parts (torchao's NF4 sharding cuts every inner tensor
    evenly), or None if none does."""
    for size in range(math.gcd(blocks, SCALER_BLOCK), 0, -1):
        if blocks % size == 0 and (blocks // size) % shards == 0:
            return size
    return None


def to_nf4(weight: torch.Tensor, name: str, shards: int = 1) -> torch.Tensor:
    """`weight` as an `NF4Tensor` (its dtype stays the weight's: what `dense` returns), cut evenly into `shards`
    FSDP2 shards where there are several. Refuses, naming it, a weight whose size is not a whole number of
    64-value blocks or whose blocks and rows cannot be shared evenly by `shards` ranks."""
    blocks = weight.numel() // BLOCK
    scaler = _scaler_block(blocks, shards) if weight.numel() % BLOCK == 0 else None
    if scaler is None or weight.shape[0] % shards:
        raise ValueError(f"model.quantization=nf4: {name} of shape {tuple(weight.shape)} cannot be stored in "
                         f"{BLOCK}-value NF4 blocks shared evenly by {shards} rank(s) (trainer.n_workers); leave that "
                         f"module out of lora.target_modules, change trainer.n_workers, or use model.quantization=none")
    return _torchao_to_nf4()(weight, BLOCK, scaler)


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
def quantize_linears(linears: dict[str, Any], device: torch.device, shards: int = 1) -> int:
    """Replaces the weight of each linear layer in `linears` (by name) with its frozen 4-bit copy, made on `device`
    one weight at a time (for FSDP2 over `shards` ranks: `to_nf4`); returns how many weights it stores in 4 bits."""
    stored = 0
    for name, linear in linears.items():
        weight = linear.weight
        quantized = to_nf4(weight.detach().to(device), f"{name}.weight", shards)
        linear.weight = torch.nn.Parameter(quantized, requires_grad=False)
        stored += weight.numel()
        del weight  # the full-precision weight goes now, before the next one is quantized
    return stored


def quantize_base(layers: dict[str, Any], device: torch.device, shards: int = 1) -> int:
    """`quantize_linears` over the frozen `base_layer` of each of peft's adapted linear `layers` (by name)."""
    return quantize_linears({name: layer.base_layer for name, layer in layers.items()}, device, shards)


def quantized_params(config: Any, lora: LoraConfig, head: str = "lm", trust_remote_code: bool = False
                     ) -> tuple[int, int]:
    """(weights stored in 4 bits, the largest of them) of a LoRA run of `lora` with a 4-bit base on the model of
    Hugging Face `config` (`head`: ``lm`` or ``value``): the adapted linear layers' weights, counted on the meta
    device."""
    from hybridflow.engine.train.lora import meta_model, resolve_targets

    sizes = [m.weight.numel() for m in resolve_targets(meta_model(config, head, trust_remote_code),
                                                        list(lora.target_modules)).values()]
    return sum(sizes), max(sizes, default=0)
