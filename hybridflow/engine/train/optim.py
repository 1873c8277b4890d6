"""The optimizer and learning-rate schedule of a training engine: AdamW, warm-up, constant or cosine.

Reads an actor/critic config section by attribute: `optimizer`, `lr`, `weight_decay`, `betas`,
`lr_schedule` (``"constant"`` | ``"cosine"``), `lr_warmup_steps`, `min_lr_ratio`. After a resume,
`apply_config` makes the config's values win over the ones restored with the optimizer and scheduler state.
Optimizers (`OPTIMIZERS`; ``auto``, where a device plan did not choose, is `default_optimizer`'s), by the device
memory their state takes per parameter:
- ``adamw``: `torch.optim.AdamW` (fused on CUDA); two tensors in the master dtype (8 bytes fp32).
- ``adamw_8bit``: torchao's `AdamW8bit`, block-quantised 8-bit moments (~2 bytes); with bf16 master
  weights its updates are stochastically rounded, so steps far below bf16's resolution still count.
- ``adamw_cpu_offload``: `cpu_adamw.CPUOffloadAdamW`, the state in host memory and the update on the
  CPU (0 bytes on the device; 8 bytes of host memory).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hybridflow.config.model_schema import EngineOptimConfig
from hybridflow.engine.budget.choices import default_optimizer

SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_cpu_offload")


def build_optimizer(params, cfg: EngineOptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` over the trainable `params`."""
    params = [p for p in params if p.requires_grad]
    name = cfg.optimizer
    if name == "auto":  # left open where no device plan chose (a CPU, an engine built directly): the default
        name = default_optimizer(2 if any(p.dtype == torch.bfloat16 for p in params) else 4)
    if name != "adamw_8bit" and any(p.dtype == torch.bfloat16 for p in params):
        raise ValueError(f"optimizer {name!r} would round every update of bf16 master weights to bf16 (most "
                         f"vanish); use optimizer=adamw_8bit (stochastic rounding) or master_dtype=fp32")
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, fused=device.type == "cuda", **kwargs)
    if name == "adamw_8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError as e:
            raise ImportError("optimizer=adamw_8bit needs torchao: pip install 'hybridflow[memory]'") from e
        # torchao reads the lr as a tensor (the lr scheduler fills it in place)
        kwargs["lr"] = torch.tensor(float(cfg.lr))
        return AdamW8bit(params, bf16_stochastic_round=any(p.dtype == torch.bfloat16 for p in params), **kwargs)
    if name == "adamw_cpu_offload":
        from hybridflow.engine.train.cpu_adamw import CPUOffloadAdamW

        return CPUOffloadAdamW(params, **kwargs)
    raise ValueError(f"optimizer {name!r} is not valid; valid: {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, total_steps: int, schedule: str, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) of a run of `total_steps` optimizer steps:
    linear warm-up reaching 1 at the `warmup_steps`-th step, then constant, or a cosine from 1 at that peak
    (step 0 without warm-up) down to `min_lr_ratio` at the last step (`total_steps - 1`) and after."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule {schedule!r} is not valid; valid: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    peak = max(warmup_steps - 1, 0)
    progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: EngineOptimConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` stepping `lr_factor` once per optimizer step."""
    schedule, warmup = cfg.lr_schedule, cfg.lr_warmup_steps
    min_ratio = cfg.min_lr_ratio
    lr_factor(0, total_steps, schedule, warmup, min_ratio)  # validates the schedule name now
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, schedule, warmup, min_ratio))


def apply_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                 cfg: EngineOptimConfig) -> None:
    """After loading a checkpoint's optimizer and scheduler state: this config's lr, betas and weight decay
    replace the saved ones, and the lr becomes this config's schedule (the scheduler's own function, built
    from this config) at the restored optimizer step, so a resumed run trains with what its config says."""
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        lr = cfg.lr * fn(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps it a tensor, filled in place
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = [float(group["lr"]) for group in optimizer.param_groups]
