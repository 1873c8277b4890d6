"""Where the FP8 rollout (`rollout.quantization=fp8`, docs/rollout.md#fp8-rollout) cannot run, refused before any
model loads, each problem naming the keys: it needs the fast engine outside exact mode, a CUDA GPU of sm_89 or
newer (checked here when the run is local), and a dense model whose shapes the FP8 GEMMs take
(`hybridflow.engine.rollout.fp8.model_problems`, read from the model's Hugging Face config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KEY = "rollout.quantization=fp8"


def fp8_problems(cfg: Any, check_paths: bool = True) -> list[str]:
    """The problems of an `RLConfig` with `rollout.quantization=fp8` ([] without it); with `check_paths` the
    model's config is read from `model.path`."""
    rollout, trainer, model = cfg.rollout, cfg.trainer, cfg.model
    if rollout.quantization != "fp8":
        return []
    problems = []
    if rollout.engine == "hf":
        problems.append(f"{KEY} with rollout.engine=hf: transformers.generate has no FP8 path; use rollout.engine=auto "
                        f"or fast")
    if rollout.exact:
        problems.append(f"{KEY} with rollout.exact=true: exact mode samples with the trainer's bf16 arithmetic bit "
                        f"for bit, which FP8 weights cannot; set one of them off")
    problems += _device_problems(trainer)
    local = model.path is not None and model.path.startswith(("/", ".", "~"))
    missing = model.path is None or (local and not Path(model.path).expanduser().exists())
    if check_paths and not missing:  # a missing model directory is reported by the path checks
        problems += _model_problems(model)
    return problems


def _device_problems(trainer: Any) -> list[str]:
    import torch

    cuda = torch.cuda.is_available()
    if trainer.device == "cpu" or (trainer.device == "auto" and not cuda and trainer.backend == "local"):
        return [f"{KEY} with trainer.device={trainer.device} (the run is on the CPU): FP8 rollout runs on CUDA GPUs "
                f"of sm_89 or newer; use rollout.quantization=none"]
    if not cuda or trainer.backend != "local":  # Ray places the workers elsewhere: their engines check their GPU
        return []
    from hybridflow.engine.rollout.fp8 import device_problems

    return [f"{KEY}: {problem}; use rollout.quantization=none" for problem in device_problems(torch.device("cuda", 0))]


def _model_problems(model: Any) -> list[str]:
    from transformers import AutoConfig

    from hybridflow.engine.rollout.fp8 import model_problems
    from hybridflow.utils.lm_class import text_view

    try:
        config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as err:  # the model checks report a missing directory; say why here
        return [f"{KEY}: cannot read model.path={model.path}'s config ({err})"]
    return [f"{KEY}: model.path={model.path}: {problem}" for problem in model_problems(text_view(config))]
