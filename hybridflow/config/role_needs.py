"""Which roles and worker groups a run's config asks for: a critic, a reference model, a distillation teacher,
ReMax's greedy baseline, multi-turn episodes, whether its prompts can carry images, and the worker groups (with
their process counts) the trainer starts. `validate` checks a config with these; the trainer builds its roles from
them."""

from __future__ import annotations

from typing import Any

from hybridflow.utils.lm_class import vision_model_type


def distills(cfg: Any) -> bool:
    """On-policy distillation: a teacher model (`teacher.model.path`) scores the sampled tokens."""
    return cfg.teacher.model.path is not None


def uses_task_advantage(cfg: Any) -> bool:
    """The advantage estimator runs on the task's scores: always, except in distillation alone
    (`teacher.task_reward=false`)."""
    return not distills(cfg) or cfg.teacher.task_reward


def needs_critic(cfg: Any) -> bool:
    """A critic (value model) is trained only for the estimator that uses values (`gae`), when it runs."""
    return cfg.algorithm.adv_estimator == "gae" and uses_task_advantage(cfg)


def needs_greedy_baseline(cfg: Any) -> bool:
    """ReMax's baseline: each prompt's greedy response, generated and scored beside its n samples."""
    return cfg.algorithm.adv_estimator == "remax" and uses_task_advantage(cfg)


def needs_reference(cfg: Any) -> bool:
    """A reference model is held only when a KL term uses it (KL loss or KL in reward)."""
    return cfg.actor.kl_loss_coef > 0 or cfg.algorithm.use_kl_in_reward


ENDPOINT_WAYS = ("runner", "verifiers", "gym", "openenv")  # agent keys that drive the model through the endpoint


def agent_keys(agent: Any) -> list[str]:
    """The `agent` keys that turn multi-turn episodes on, as set: an environment, tools, or ways in through the
    OpenAI-compatible endpoint (`agent.runner`, ...)."""
    if agent is None:
        return []
    return [f"agent.{key}" for key in ("environment", "tools", *ENDPOINT_WAYS) if getattr(agent, key, None)]


def endpoint_ways(agent: Any) -> list[str]:
    """The ways in through the OpenAI-compatible endpoint that are set (`ENDPOINT_WAYS`), as keys: "agent.runner"."""
    return [f"agent.{way}" for way in ENDPOINT_WAYS if getattr(agent, way, None)]


def agent_enabled(agent: Any) -> bool:
    """Multi-turn episodes are on (`agent_keys`)."""
    return bool(agent_keys(agent))


def agent_setting(agent: Any) -> str:
    """The keys of `agent_keys` that are set, for a message: "agent.runner", "agent.environment and agent.tools"."""
    return " and ".join(agent_keys(agent))


def endpoint_images(cfg: Any) -> bool:
    """The endpoint's requests may carry images (`agent.images`): as set, or, unset (null), whether `model.path` is
    only a vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3: `lm_class.vision_model_type`), not a text model nor
    a `TEXT_FIRST_FAMILIES` checkpoint (Qwen3.5 as published, whose language model then trains alone). The loader
    writes the value it follows to (`config.follow`); a config built in Python leaves it null, resolved here."""
    images = getattr(getattr(cfg, "agent", None), "images", None)
    if images is not None:
        return bool(images)
    return vision_model_type(getattr(getattr(cfg, "model", None), "path", None)) is not None


def carries_images(cfg: Any) -> bool:
    """The run's prompts can carry images: the dataset's (`data.image_key`), or an endpoint request's `image_url`
    parts (an endpoint way in: `agent.runner`, ..., with `endpoint_images`). The one place that decides it: with a
    vision tower, a checkpoint is then the vision-language model it is (`lm_class`'s `images`; a Qwen3.5 checkpoint
    as published trains as its language model alone otherwise). Any training program's config: the SFT and
    preference programs' have neither key (their prompts carry no images)."""
    if getattr(getattr(cfg, "data", None), "image_key", None) is not None:
        return True
    return bool(endpoint_ways(getattr(cfg, "agent", None))) and endpoint_images(cfg)


def rollout_workers(cfg: Any) -> int:
    """Processes of the separate rollout group (`rollout.n_workers`, null = `trainer.n_workers`)."""
    return cfg.rollout.n_workers or cfg.trainer.n_workers


# Each group's pool: the `ray.<section>` that shapes it and the key that sizes it.
GROUP_KEYS = {"actor": ("actor", "trainer.n_workers"), "critic": ("actor", "trainer.n_workers"),
              "rollout": ("rollout", "rollout.n_workers")}


def run_groups(cfg: Any) -> dict[str, int]:
    """The worker groups an RL run starts, named as their `ray.<name>` sections, with their process counts:
    the actor (with the roles colocated with it), the critic when split off, the rollout when separate."""
    pools = {"actor": cfg.trainer.n_workers}
    if needs_critic(cfg) and cfg.trainer.placement == "split":
        pools["critic"] = cfg.trainer.n_workers
    if cfg.rollout.placement == "separate":
        pools["rollout"] = rollout_workers(cfg)
    return pools
