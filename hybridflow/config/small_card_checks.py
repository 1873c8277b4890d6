"""The checks of the small-card keys, before any model loads, each problem one line naming the keys: a memory cap
(`trainer.device_memory_gib`) must be positive, and a 4-bit base (`<model>.quantization=nf4`, QLoRA) needs LoRA
on its role, torchao, and adapters on linear layers only; its 4-bit weights stay on the device and exact mode's
kernels take plain weights. The cap's comparison with the card and with the weights' size is the device plan's
(`hybridflow.engine.budget.cap`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from hybridflow.config.extras import config_value


def cap_problems(cfg: Any) -> list[str]:
    """`trainer.device_memory_gib`: null or a positive number of GiB."""
    cap = cfg.trainer.device_memory_gib
    if cap is not None and cap <= 0:
        return [f"trainer.device_memory_gib={cap} must be > 0 (GiB per GPU), or null for the whole card"]
    return []


def quantization_problems(cfg: Any, sections: tuple[tuple[str, str], ...]) -> list[str]:
    """Each (optimizer section, model section) whose model has `quantization=nf4`."""
    problems = []
    for role, model in sections:
        if config_value(cfg, f"{model}.quantization") != "nf4":
            continue
        setting = f"{model}.quantization=nf4"
        lora = config_value(cfg, f"{role}.lora")
        if lora.rank <= 0:
            problems.append(f"{setting} stores the frozen base of a LoRA model in 4 bits; it needs {role}.lora.rank "
                            f"> 0 (got {lora.rank}), or use {model}.quantization=none to train every weight")
        if lora.target_parameters:
            problems.append(f"{setting} quantizes adapted linear layers; {role}.lora.target_parameters="
                            f"{list(lora.target_parameters)} (stacked expert weights) is not supported with it: use "
                            f"{role}.lora.target_parameters=[] or {model}.quantization=none")
        if config_value(cfg, f"{role}.param_offload"):
            problems.append(f"{setting} keeps its 4-bit weights on the device (a quarter of bf16's); set "
                            f"{role}.param_offload=false")
        if importlib.util.find_spec("torchao") is None:
            problems.append(f"{setting} needs the torchao package: pip install 'hybridflow[memory]'")
        rollout = getattr(cfg, "rollout", None)
        if rollout is not None and rollout.exact:
            problems.append(f"{setting} with rollout.exact=true: exact mode's batch-invariant kernels take plain "
                            f"weights; use {model}.quantization=none or rollout.exact=false")
    return problems
