"""Defaults that follow other keys: turning a feature on needs that key alone when what it needs of another key
has one value (`FOLLOWS`). The loader (`hybridflow.config.loader.load_config`) gives each such key the value its
feature needs when neither a YAML file nor an override set it (or set it to `auto`, for a key whose `auto` asks
for this choice); a key that was set keeps its value, and the checks (`hybridflow.config.validate`) refuse it,
naming both keys, before any model loads.

    hybridflow train ... rollout.partial=true     # rollout.free_cache_after_generate follows: false
    hybridflow train ... model.quantization=nf4 trainer.device_memory_gib=6    # rollout.quantization follows: fp8

`followed_lines(cfg)` says which keys of a config hold the value another key asks for, and why (whether they
followed or were set so: the config alone does not tell): `hybridflow config` prints them, and a run writes them
at the top of its `resolved_config.yaml` (`followed_comment`: YAML comments, so the file loads again with
`--config`). A config built in Python (`RLConfig(...)`) has no unset keys: what it does not pass is its
default, so nothing follows there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from hybridflow.config.fp8_checks import fp8_problems
from hybridflow.config.ray_schema import PoolConfig, RayConfig
from hybridflow.config.role_needs import endpoint_ways
from hybridflow.config.validate import changed_keys
from hybridflow.utils.lm_class import TEXT_FIRST_FAMILIES, vision_model_type

__all__ = ["FOLLOWS", "Follows", "follow_defaults", "followed_comment", "followed_lines"]


@dataclass(frozen=True)
class Follows:
    """`key` takes `value` when `because(cfg)` gives a reason (the keys that ask for it; None = nothing asks) and
    it was left unset, or set to `auto` (a value that asks for this choice: `reward.function=auto`); `when`
    says in which case, for the configuration reference."""

    key: str
    value: Any
    because: Callable[[Any], str | None]
    when: str
    auto: Any = None


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _has(cfg: Any, key: str) -> bool:
    """`cfg`'s schema has `key`: a rule of the RL config is skipped for the SFT and preference configs (a schema
    holding a rule's key holds the keys its reason reads)."""
    try:
        _value(cfg, key)
    except AttributeError:
        return False
    return True


def _partial_continues(cfg: Any) -> str | None:
    rollout = cfg.rollout
    if rollout.partial and rollout.partial_unfinished == "continue":
        return ("rollout.partial=true with rollout.partial_unfinished=continue keeps unfinished samples' KV slots "
                "from one step to the next")
    return None


def _endpoint_reward(cfg: Any) -> str | None:
    ways = endpoint_ways(cfg.agent)
    if ways and not cfg.reward.functions:
        return f"{ways[0]} returns each trajectory's reward"
    return None


def _replays_rollout_routes(cfg: Any) -> str | None:
    if cfg.actor.router_replay == "rollout":
        return "actor.router_replay=rollout replays the experts the rollout engine recorded"
    return None


def _adaptive_kl(cfg: Any) -> str | None:
    if cfg.algorithm.kl_ctrl.type == "adaptive":
        return "algorithm.kl_ctrl.type=adaptive controls the in-reward KL"
    return None


def _separate_rollout(cfg: Any) -> str | None:
    if cfg.rollout.pipeline:
        return "rollout.pipeline=true generates the next step's samples on the rollout's own devices"
    if cfg.rollout.n_workers is not None:
        return f"rollout.n_workers={cfg.rollout.n_workers} sizes the separate rollout group"
    if changed := changed_keys(cfg.ray.rollout, PoolConfig(), "ray.rollout"):
        return f"{', '.join(changed)} place the separate rollout group"
    return None


def _ray_cluster(cfg: Any) -> str | None:
    ray = getattr(cfg, "ray", None)  # the SFT and preference programs have no `ray` section
    if ray is not None and (changed := changed_keys(ray, RayConfig(), "ray")):
        return f"{', '.join(changed)} place worker groups on a Ray cluster"
    return None


def _fp8_rollout(cfg: Any) -> str | None:
    if cfg.rollout.quantization == "fp8":
        return ("rollout.quantization=fp8 samples with FP8 weights, whose per-token log-prob noise truncated "
                "importance weights correct (docs/rollout.md#fp8-rollout)")
    return None


def _vision_model(cfg: Any) -> str | None:
    model_type = vision_model_type(getattr(getattr(cfg, "model", None), "path", None))
    if model_type is None or endpoint_ways(getattr(cfg, "agent", None)):  # an endpoint's runner sends
        return None  # the images with its requests: the dataset's are not read
    return f"model.path is a vision-language model ({model_type}) whose prompts carry images"


def _endpoint_way(cfg: Any) -> str | None:
    return next(iter(endpoint_ways(cfg.agent)), None)


def _vision_endpoint(cfg: Any) -> str | None:
    way, model_type = _endpoint_way(cfg), vision_model_type(cfg.model.path)
    if way is None or model_type is None:
        return None
    return f"model.path is a vision-language model ({model_type}): the requests of {way} may carry images"


def _text_first_endpoint(cfg: Any) -> str | None:
    way, model_type = _endpoint_way(cfg), vision_model_type(cfg.model.path, images=True)
    if way is None or model_type not in TEXT_FIRST_FAMILIES:
        return None
    return (f"model.path is a {model_type} checkpoint as published: through {way} its language model trains alone, "
            f"as text, on the fast engine (agent.images=true: the vision-language model, its requests carrying "
            f"images)")


def _nf4_under_cap(cfg: Any) -> str | None:
    """A 4-bit base on a capped card samples from FP8 weights, where the FP8 rollout can run (`fp8_checks` finds no
    problem with it: a CUDA GPU of sm_89+, the fast engine, no exact mode, a dense model)."""
    cap = cfg.trainer.device_memory_gib
    if cfg.model.quantization != "nf4" or cap is None:
        return None
    fp8 = SimpleNamespace(rollout=replace(cfg.rollout, quantization="fp8"), trainer=cfg.trainer, model=cfg.model)
    if fp8_problems(fp8):
        return None
    return (f"model.quantization=nf4 under trainer.device_memory_gib={cap:g}: the rollout keeps FP8 weights made at "
            f"each sync from the 4-bit base plus the adapters, half a bf16 copy's bytes (docs/small_gpus.md)")


def _bf16_master(model: str) -> Callable[[Any], str | None]:
    def because(cfg: Any) -> str | None:
        if _value(cfg, f"{model}.master_dtype") == "bf16":
            return (f"{model}.master_dtype=bf16 needs the optimizer whose stochastic rounding keeps updates below "
                    f"bf16's resolution")
        return None

    return because


# Each a key whose other values the checks refuse once its feature is on, or whose feature came with its rule
# (rollout.quantization=fp8: the other correction modes stay valid), so following changes no config that ran
# before. In order: a rule may read a key an earlier one set (rollout.placement before what reads it).
FOLLOWS: tuple[Follows, ...] = (
    Follows("rollout.free_cache_after_generate", False, _partial_continues,
            "`rollout.partial=true` (with the default `rollout.partial_unfinished=continue`)"),
    Follows("reward.function", "environment", _endpoint_reward,
            "`agent.runner`, `agent.verifiers`, `agent.gym` or `agent.openenv` is set and `reward.functions` is "
            "empty", auto="auto"),
    Follows("rollout.record_routes", True, _replays_rollout_routes, "`actor.router_replay=rollout`"),
    Follows("algorithm.use_kl_in_reward", True, _adaptive_kl, "`algorithm.kl_ctrl.type=adaptive`"),
    Follows("rollout.placement", "separate", _separate_rollout,
            "`rollout.pipeline=true`, `rollout.n_workers` is set, or a `ray.rollout.*` key differs from its default"),
    Follows("trainer.backend", "ray", _ray_cluster, "a `ray.*` key differs from its default"),
    Follows("rollout.quantization", "fp8", _nf4_under_cap,
            "`model.quantization=nf4` with `trainer.device_memory_gib` set, where the FP8 rollout can run (a CUDA GPU "
            "of sm_89 or newer, the fast engine, not exact mode, a dense model)"),
    Follows("actor.rollout_correction.mode", "token_tis", _fp8_rollout, "`rollout.quantization=fp8`"),
    Follows("actor.optimizer", "adamw_8bit", _bf16_master("model"), "`model.master_dtype=bf16`"),
    Follows("data.image_key", "images", _vision_model,
            "`model.path` is a vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3) and no endpoint way in (`agent.runner`, "
            "...) is set"),
    Follows("agent.images", True, _vision_endpoint,
            "an endpoint way in (`agent.runner`, ...) is set and `model.path` is a vision-language model (Qwen2.5-VL, "
            "Qwen3-VL, Gemma 3)"),
    Follows("agent.images", False, _text_first_endpoint,
            "an endpoint way in (`agent.runner`, ...) is set and `model.path` is a Qwen3.5 checkpoint as published "
            "(`qwen3_5`, with its vision tower)"),
    Follows("critic.optimizer", "adamw_8bit", _bf16_master("critic.model"), "`critic.model.master_dtype=bf16`"),
    Follows("optim.optimizer", "adamw_8bit", _bf16_master("model"),
            "`model.master_dtype=bf16` (`hybridflow sft`, `dpo`, `rm`)"),
)


def follow_defaults(cfg: Any, given: Collection[str]) -> None:
    """Sets, in place, each key of `FOLLOWS` that is not in `given` (the dotted keys a file or override set), or
    holds its `auto` value, to the value its feature needs, where that feature is on."""
    for rule in FOLLOWS:
        if not _has(cfg, rule.key) or rule.because(cfg) is None:
            continue
        if rule.key in given and (rule.auto is None or _value(cfg, rule.key) != rule.auto):
            continue
        *parents, leaf = rule.key.split(".")
        setattr(_value(cfg, ".".join(parents)), leaf, rule.value)


def followed_lines(cfg: Any) -> list[str]:
    """`key=value: why` for each key of `FOLLOWS` holding the value its feature needs (followed, or set so)."""
    lines = []
    for rule in FOLLOWS:
        if not _has(cfg, rule.key) or _value(cfg, rule.key) != rule.value:
            continue
        why = rule.because(cfg)
        if why is not None:
            shown = str(rule.value).lower() if isinstance(rule.value, bool) else rule.value
            lines.append(f"{rule.key}={shown}: {why}")
    return lines


def followed_comment(cfg: Any) -> str:
    """`followed_lines` as YAML comment lines for the top of a printed or written config ("" when none)."""
    lines = followed_lines(cfg)
    if not lines:
        return ""
    return ("# keys holding the value another key needs (followed when left unset; docs/config.md):\n"
            + "".join(f"#   {line}\n" for line in lines))
