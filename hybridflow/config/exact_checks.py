"""Where exact mode (`rollout.exact`, docs/exact.md) cannot hold, refused before any model loads, each problem
naming the key, its value and why: the rollout must run the fast engine's invariant kernels, sample from the
whole softmax, and feed a trainer whose forward is the rollout's (packed, eager, without dropout), on a model
the kernels cover (`hybridflow.engine.invariant.scope`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def exact_problems(cfg: Any, check_paths: bool = True) -> list[str]:
    """The problems of an `RLConfig` with `rollout.exact=true` ([] without it); with `check_paths` the model's
    Hugging Face config is read from `model.path` to check its architecture and shape."""
    rollout, actor, model = cfg.rollout, cfg.actor, cfg.model
    if not rollout.exact:
        return []
    problems = []
    if rollout.engine == "hf":
        problems.append("rollout.exact=true with rollout.engine=hf: transformers.generate runs other kernels than the "
                        "trainer's; use rollout.engine=auto or fast")
    if rollout.top_k != -1 or rollout.top_p != 1.0:
        problems.append(f"rollout.exact=true with rollout.top_k={rollout.top_k} / rollout.top_p={rollout.top_p}: the "
                        f"trainer's log-prob is under the whole softmax, a truncated sample's is not; use "
                        f"rollout.top_k=-1 rollout.top_p=1.0")
    if actor.rollout_correction.mode != "none":
        problems.append(f"rollout.exact=true makes pi_train / pi_rollout exactly 1, so "
                        f"actor.rollout_correction.mode={actor.rollout_correction.mode} has nothing to correct; set "
                        f"actor.rollout_correction.mode=none")
    if model.compile:
        problems.append("rollout.exact=true with model.compile=true: compiled layers fuse the elementwise ops around "
                        "the invariant kernels and change their rounding; exact mode runs eager layers (model.compile="
                        "null or false)")
    if not actor.use_packing or model.attn_implementation != "sdpa":
        problems.append(f"rollout.exact=true needs actor.use_packing=true and model.attn_implementation=sdpa (the "
                        f"exact attention takes packed rows); got {actor.use_packing} and "
                        f"{model.attn_implementation!r}")
    if actor.lora.rank > 0 and actor.lora.dropout > 0:
        problems.append(f"rollout.exact=true with actor.lora.dropout={actor.lora.dropout}: dropout in the update's "
                        f"forward makes it differ from the rollout's; use actor.lora.dropout=0")
    local = model.path is not None and model.path.startswith(("/", ".", "~"))
    missing = model.path is None or (local and not Path(model.path).expanduser().exists())
    if check_paths and not missing:  # a missing model directory is reported by the path checks
        problems += _model_problems(model)
    return problems


def _model_problems(model: Any) -> list[str]:
    from transformers import AutoConfig

    from hybridflow.engine.invariant import unsupported
    from hybridflow.utils.lm_class import text_view

    try:
        config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as err:  # the model checks report a missing directory; say why here
        return [f"rollout.exact=true: cannot read model.path={model.path}'s config ({err})"]
    return [f"rollout.exact=true: model.path={model.path}: {problem}" for problem in unsupported(text_view(config))]
