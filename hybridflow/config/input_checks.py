"""Checks of what a run will read, before any model loads: model directories, data files, the reward functions,
the environment and tools, the resume checkpoint, a visible GPU, LoRA's targets on the model (`extras`), a
distillation teacher's tokenizer, and what a vision-language model's run cannot do.

Each function returns the problems it found as messages naming the key and its value (`validate` and
`validate_sft` in `hybridflow.config.validate` gather them into one `ConfigError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.config.extras import config_value, lora_target_problems
from hybridflow.config.role_needs import (ENDPOINT_WAYS, carries_images, distills, endpoint_ways, needs_critic,
                                          rollout_workers)
from hybridflow.utils.lm_class import TEXT_FIRST_FAMILIES, VISION_FAMILIES, config_fields, vision_model_type


def model_problems(cfg: Any, keys: tuple[str, ...]) -> list[str]:
    """`model.path` is required; each local model directory under `keys` must exist."""
    required = [] if cfg.model.path is not None else ["model.path is required (a Hugging Face model directory)"]
    return required + directory_problems(cfg, keys)


def directory_problems(cfg: Any, keys: tuple[str, ...]) -> list[str]:
    """Each local model directory under `keys` (a path, not a hub id) must exist."""
    return [f"{key}={value}: no such directory" for key in keys if (value := config_value(cfg, key)) is not None
            and value.startswith(("/", ".", "~")) and not Path(value).expanduser().exists()]


def data_file_problems(cfg: Any) -> list[str]:
    """`data.train_files` is required; every training and validation file must exist."""
    problems = []
    if not cfg.data.train_files:
        problems.append("data.train_files is required (one parquet/jsonl path or a list)")
    for key in ("data.train_files", "data.val_files"):
        for path in config_value(cfg, key):
            if Path(path).expanduser().is_dir():
                problems.append(f"{key}: {path} is a directory; give a .parquet or .jsonl file in it (or a list "
                                f"of them)")
            elif not Path(path).expanduser().is_file():
                problems.append(f"{key}: file {path} not found")
    return problems


def resume_problems(cfg: Any) -> list[str]:
    """`trainer.resume` must be auto, never or a path that exists."""
    resume = cfg.trainer.resume
    if resume not in ("auto", "never") and not Path(resume).expanduser().exists():
        return [f"trainer.resume={resume!r}: no such checkpoint; valid: auto, never, or an existing path"]
    return []


def run_problems(cfg: Any) -> list[str]:
    """The run's resume checkpoint must exist; `trainer.device=cuda` on the local backend needs a visible GPU."""
    problems = resume_problems(cfg)
    if cfg.trainer.device == "cuda" and cfg.trainer.backend == "local":  # Ray's GPUs: `check_capacity`
        import torch

        if not torch.cuda.is_available():
            problems.append("trainer.device=cuda but no CUDA device is visible; valid here: auto, cpu")
    return problems


def teacher_problems(cfg: Any) -> list[str]:
    """A distillation teacher's directories must exist, its tokenizer must be the policy's (it scores the
    policy's token ids, so both need one vocabulary), and `teacher.topk` must not exceed its logits."""
    if not distills(cfg):
        return []
    problems = directory_problems(cfg, ("teacher.model.path", "teacher.model.tokenizer_path"))
    student = cfg.model.tokenizer_path or cfg.model.path
    teacher = cfg.teacher.model.tokenizer_path or cfg.teacher.model.path
    if problems or student is None or not all(Path(p).expanduser().is_dir() for p in (student, teacher)):
        return problems
    from transformers import AutoConfig, AutoTokenizer

    if cfg.teacher.topk:
        path = cfg.teacher.model.path
        logits = AutoConfig.from_pretrained(path, trust_remote_code=cfg.teacher.model.trust_remote_code).vocab_size
        if cfg.teacher.topk > logits:
            problems.append(f"teacher.topk={cfg.teacher.topk} is more than the teacher's {logits} logits (vocab_size "
                            f"in {path}/config.json): set teacher.topk to at most {logits}")
    ours = AutoTokenizer.from_pretrained(student, trust_remote_code=cfg.model.trust_remote_code).get_vocab()
    theirs = AutoTokenizer.from_pretrained(teacher, trust_remote_code=cfg.teacher.model.trust_remote_code).get_vocab()
    if ours == theirs:
        return problems
    differ = sorted(set(ours.items()) ^ set(theirs.items()))
    return problems + [
        f"teacher.model: the tokenizer at {teacher} ({len(theirs)} tokens) is not the policy's at {student} "
        f"({len(ours)} tokens; {len(differ)} token-id pairs differ, e.g. {differ[0]}): the teacher scores the "
        f"policy's token ids, so both need one vocabulary"]


# the rollout options VisionRolloutEngine has no path for, with the values that ask for nothing
VISION_ROLLOUT_PLAIN = (("engine", "auto"), ("exact", False), ("quantization", "none"), ("record_routes", False),
                        ("partial", False))


def vision_rollout_problems(rollout: Any) -> list[str]:
    """The `rollout` options a vision-language model's engine (`VisionRolloutEngine`) cannot serve."""
    return [f"rollout.{key}={getattr(rollout, key)!r}: a vision-language model's rollout (VisionRolloutEngine) has no "
            f"such path; leave it at {plain!r}" for key, plain in VISION_ROLLOUT_PLAIN if getattr(rollout, key) != plain]


def vision_problems(cfg: Any) -> list[str]:
    """What a vision-language model's run (`model.path` holds one) cannot do: a family other than
    `VISION_FAMILIES`, prompts without images, a critic, rollout options its engine lacks, the in-process agent loop,
    and, through the endpoint, dataset images or more than one rollout rank (`endpoint_vision_problems`)."""
    model_type = vision_model_type(cfg.model.path, images=carries_images(cfg))
    if model_type is None:
        return []
    if model_type not in VISION_FAMILIES:
        return [f"model.path={cfg.model.path}: vision-language model_type {model_type!r} is not supported (its image "
                f"inputs and rotary positions differ); supported: {', '.join(VISION_FAMILIES)}"]
    problems = vision_rollout_problems(cfg.rollout)
    endpoint = endpoint_ways(cfg.agent)
    if cfg.data.image_key is None and not endpoint:
        problems.append(f"data.image_key=null: model.path={cfg.model.path} is a vision-language model ({model_type}), "
                        f"whose prompts need images; set it to the column holding them (verl's geo3k: images)")
    if needs_critic(cfg):
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: a critic for the vision-language "
                        f"model {model_type} is not supported; use a critic-free estimator (grpo, rloo, ...)")
    loop = [f"agent.{key}" for key in ("environment", "tools") if getattr(cfg.agent, key, None)]
    if loop:
        problems.append(f"{' and '.join(loop)}: multi-turn episodes of the vision-language model {model_type} in the "
                        f"in-process agent loop are not supported (the loop continues live sequences, which its "
                        f"rollout engine does not keep); drive it through the endpoint (agent.runner, agent.gym, "
                        f"agent.verifiers, agent.openenv), whose requests carry images as image_url parts")
    elif endpoint:
        problems += endpoint_vision_problems(cfg, endpoint[0])
    if problems and model_type in TEXT_FIRST_FAMILIES and cfg.data.image_key is None:
        # agent.images=true alone made this checkpoint a vision-language model: say how its text model runs instead
        problems.append(f"agent.images=true: the {model_type} checkpoint at model.path={cfg.model.path} is the "
                        f"vision-language model; with agent.images unset (or false), {endpoint[0]} trains its "
                        f"language model alone, as text, on the fast engine")
    return problems


def agent_images_problems(cfg: Any) -> list[str]:
    """`agent.images` set against what `model.path` is (read from its config.json): true for a model without a vision
    tower, false for a vision-language model that trains only as one (not a `TEXT_FIRST_FAMILIES` checkpoint)."""
    images, fields = cfg.agent.images, config_fields(cfg.model.path)
    if images is None or fields is None or not endpoint_ways(cfg.agent):
        return []
    model_type = fields.get("model_type")
    if images and "vision_config" not in fields:
        return [f"agent.images=true: model.path={cfg.model.path} (model_type {model_type!r}) has no vision tower (no "
                f"vision_config in its config.json), so it cannot read images; leave agent.images unset for a text "
                f"model"]
    if not images and "vision_config" in fields and model_type not in TEXT_FIRST_FAMILIES:
        return [f"agent.images=false: model.path={cfg.model.path} is a vision-language model ({model_type}), which "
                f"trains only as one, its requests carrying images or not (a language model trains alone only for "
                f"{', '.join(TEXT_FIRST_FAMILIES)}); unset, it follows true"]
    return []


def endpoint_vision_problems(cfg: Any, way: str) -> list[str]:
    """A vision-language model through the endpoint (`way`, e.g. agent.runner): the runner writes the prompts with
    their images, so the dataset's images are not read; and one rollout rank, whose rows' images are padded to their
    own widths (another rank's would not concatenate with them)."""
    problems = []
    if cfg.data.image_key is not None:
        problems.append(f"data.image_key={cfg.data.image_key} with {way}: the runner writes the prompts and sends "
                        f"their images as image_url parts, so the dataset's images are not encoded; set "
                        f"data.image_key=null (a row's image column then reaches the runner as it is, in "
                        f"row['columns'])")
    ranks = rollout_workers(cfg) if cfg.rollout.placement == "separate" else cfg.trainer.n_workers
    if ranks > 1:
        key = "rollout.n_workers" if cfg.rollout.placement == "separate" else "trainer.n_workers"
        problems.append(f"{key}={ranks} with {way} and a vision-language model: its trajectories' images are padded "
                        f"per rollout rank, which do not concatenate across ranks yet; use one rollout rank")
    return problems


def path_problems(cfg: Any) -> list[str]:
    """What an RL run will read: data files, the reward function, a resume checkpoint, model directories, the
    environment and tools, a distillation teacher."""
    problems = model_problems(cfg, ("model.path", "model.tokenizer_path", "critic.model.path",
                                    "reward.reward_model.path"))
    if cfg.model.path is None and needs_critic(cfg) and cfg.critic.model.path is None:
        problems.append("algorithm.adv_estimator=gae needs a critic model: critic.model.path, "
                        "or model.path (the critic then starts from the actor's model)")
    problems += data_file_problems(cfg)
    problems += lora_target_problems(cfg, (("actor", "model.path", "lm"),
                                           ("critic", "critic.model.path" if cfg.critic.model.path else "model.path",
                                            "value")) if needs_critic(cfg) else (("actor", "model.path", "lm"),))
    from hybridflow.rewards import RewardSpec, Scorer

    try:  # resolves names, imports users' files, binds each function's parameters
        Scorer(RewardSpec.from_config(cfg.reward))
    except (Exception, SystemExit) as e:  # the reward registry raises ValueError, OSError, AttributeError, ...
        key = "reward.functions" if cfg.reward.functions else "reward.function"
        why = f"importing it raised SystemExit({e.code!r})" if isinstance(e, SystemExit) else str(e)
        problems.append(f"{key}={config_value(cfg, key)!r}: {why}")
    from hybridflow.agents.loop.host import tool_schemas

    for way in ENDPOINT_WAYS:  # user code runs in the runner process only: here its file must exist
        spec = getattr(cfg.agent, way) or ""
        target = spec.rpartition(":")[0] if ":" in spec and not spec.endswith(".py") else spec
        if target.endswith(".py") and not Path(target).expanduser().is_file():
            problems.append(f"agent.{way}={spec!r}: the file {target!r} does not exist")
    try:  # a process of their own imports the environment's file and builds every tool, before any model loads
        tool_schemas(cfg.agent)
    except (ValueError, RuntimeError) as e:
        problems.append(str(e))
    return problems + teacher_problems(cfg) + run_problems(cfg) + agent_images_problems(cfg) + vision_problems(cfg)
