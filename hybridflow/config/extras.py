"""What a run needs beyond its keys, checked with the config before any model loads: the optional packages
its settings use (a logger, the 8-bit optimizer, LoRA, Ray), LoRA's target modules on the model's own
layers (built on the meta device, no weights read), and a mixture of experts for the MoE settings. Each
problem names the key, and the pip command or the valid module names."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hybridflow.config.role_needs import needs_critic


def config_value(cfg: Any, key: str) -> Any:
    """The value of dotted `key` (`actor.lora.rank`) in a config."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _trained_sections(cfg: Any) -> list[str]:
    """The config sections holding an optimizer (`actor`, `critic` when a critic trains; SFT's `optim`)."""
    if hasattr(cfg, "optim"):
        return ["optim"]
    return ["actor", "critic"] if needs_critic(cfg) else ["actor"]


def package_problems(cfg: Any) -> list[str]:
    """`key=value needs the X package: pip install '...'` for each optional package a setting needs and this
    Python lacks."""
    needs: list[tuple[str, str, str]] = []  # (setting, module, pip requirement)
    if "wandb" in cfg.trainer.loggers:
        needs.append(("trainer.loggers includes 'wandb' (set WANDB_MODE=offline to log without an account)",
                      "wandb", "wandb"))
    if cfg.trainer.backend == "ray":
        needs.append(("trainer.backend=ray", "ray", "hybridflow[ray]"))
    for section in _trained_sections(cfg):
        optimizer = config_value(cfg, f"{section}.optimizer")
        model = "critic.model" if section == "critic" else "model"
        if optimizer == "adamw_8bit" or (optimizer == "auto" and config_value(cfg, f"{model}.master_dtype") == "bf16"):
            needs.append((f"{section}.optimizer={optimizer}", "torchao", "hybridflow[memory]"))
        rank = config_value(cfg, f"{section}.lora.rank")
        if rank > 0:
            needs.append((f"{section}.lora.rank={rank}", "peft", "hybridflow[lora]"))
    return [f"{setting} needs the {module} package: pip install '{requirement}'"
            for setting, module, requirement in needs if importlib.util.find_spec(module) is None]


def lora_target_problems(cfg: Any, sections: tuple[tuple[str, str, str], ...]) -> list[str]:
    """Each `(optimizer section, model key, head)` training LoRA on a local model directory: its
    `lora.target_modules` must name linear layers of the model's decoder layers, its `lora.target_parameters`
    stacked expert weights."""
    from hybridflow.engine.train.lora import meta_model, resolve_parameters, resolve_targets, target_names

    problems = []
    for section, model_key, head in sections:
        lora, path = config_value(cfg, f"{section}.lora"), config_value(cfg, model_key)
        if lora.rank <= 0 or path is None or not (Path(path).expanduser() / "config.json").is_file():
            continue
        try:
            target_names(lora.target_modules)  # a malformed name is the range checks' to report
        except ValueError:
            continue
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        model = meta_model(config, head, cfg.model.trust_remote_code)
        try:
            resolve_targets(model, list(lora.target_modules))
            resolve_parameters(model, list(lora.target_parameters))
        except ValueError as e:
            problems.append(f"{section}.{e} (model {path})")
    return problems


def moe_model_problems(cfg: Any) -> list[str]:
    """Route recording, replay and the router aux loss need a mixture of experts the fast engine knows."""
    actor, uses = cfg.actor, []
    if cfg.rollout.record_routes:
        uses.append("rollout.record_routes=true")
    if actor.router_replay != "none":
        uses.append(f"actor.router_replay={actor.router_replay}")
    if actor.router_aux_loss_coef > 0:
        uses.append(f"actor.router_aux_loss_coef={actor.router_aux_loss_coef}")
    path = cfg.model.path
    if not uses or path is None or not (Path(path).expanduser() / "config.json").is_file():
        return []
    from transformers import AutoConfig

    from hybridflow.utils.moe_spec import MOE_ARCHITECTURES, moe_spec

    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    if moe_spec(config) is None:
        return [f"{', '.join(uses)} need a mixture of experts of {', '.join(MOE_ARCHITECTURES)}; model.path={path} "
                f"is a {config.model_type!r} model"]
    return []
