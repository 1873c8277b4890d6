"""The served base models, each loaded once, and the training clients' models built on them.

`BaseModels(paths, device)` loads a base model (a Hugging Face causal LM, fp32, frozen) the first time a client
asks for it. `lora_model(name)` gives a LoRA client its own module tree whose frozen weights are the base's own
tensors (a deep copy that shares every parameter), so several LoRA clients of one base hold its weights once
and differ only in their adapters; `full_model(name)` gives a full-parameter client a copy of every weight,
all trained. A client's model is freed with the client; the base stays loaded while the server runs.

With `quantization="nf4"` (QLoRA, `hybridflow serve --quantization nf4`) the frozen weight of every linear layer of
the decoder layers (the projections LoRA clients adapt) is stored once as torchao's 4-bit NormalFloat tensor
(`engine.train.quantized_base`), quantized on the device one weight at a time, and shared by every LoRA client of
that base: about 0.52 bytes a weight instead of 4. A full-parameter client needs the weights in full precision,
and is refused, naming the flag.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import torch

from hybridflow.engine.train.lora import resolve_targets
from hybridflow.engine.train.quantized_base import quantize_linears


class BaseModels:
    """Base-model name -> its directory, and each one loaded once (see the module docstring)."""

    def __init__(self, paths: dict[str, Path], device: str, quantization: str = "none") -> None:
        self.paths = paths
        self.device = torch.device(device)
        self.quantization = quantization
        self._loaded: dict[str, Any] = {}

    def path(self, name: str | None) -> Path:
        """The directory of served base model `name`; a `ValueError` naming the served ones otherwise."""
        if name not in self.paths:
            raise ValueError(f"base model {name!r} is not served here; served: {sorted(self.paths)} "
                             f"(start hybridflow serve with --model NAME=PATH)")
        return self.paths[name]

    def base(self, name: str) -> Any:
        """The frozen base model `name` on the device, loaded the first time."""
        if name not in self._loaded:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.path(name), dtype=torch.float32)
            model.requires_grad_(False)
            if self.quantization == "nf4":  # the decoder layers' linear layers: LoRA's default targets
                quantize_linears(resolve_targets(model, []), self.device)
            cast(torch.nn.Module, model).to(self.device)  # transformers types `to` for dtypes only
            self._loaded[name] = model
        return self._loaded[name]

    def lora_model(self, name: str) -> Any:
        """A module tree of base `name` whose parameters are the base's own tensors (adapters go on it, not on
        the base): `deepcopy` finds every parameter already in its memo and keeps it, copying modules and
        buffers only."""
        base = self.base(name)
        return copy.deepcopy(base, memo={id(p): p for p in base.parameters()})

    def full_model(self, name: str) -> Any:
        """A copy of base `name` with every weight its own and trained."""
        if self.quantization != "none":
            raise ValueError(f"a full-parameter client (no lora_config, or rank 0) trains every weight, which this "
                             f"server stores in 4 bits (--quantization {self.quantization}); ask for a LoRA client, "
                             f"or start another server without --quantization")
        model = copy.deepcopy(self.base(name))
        model.requires_grad_(True)
        return model
