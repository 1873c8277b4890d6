"""Which transformers Auto class builds a model with its language-model head: a vision-language model's
(`AutoModelForImageTextToText`: Qwen2.5-VL's, Qwen3-VL's, Gemma 3's, Qwen3.5's or SmolVLM's vision tower, language
model and head) or a causal LM's (`AutoModelForCausalLM`). Every place that loads, sizes, checkpoints or exports the
policy asks here, so a vision-language model takes the same paths as a text one; `vision_model_type` tells a
vision-language model's directory from its config.json alone (the config checks ask it before anything loads).

A `TEXT_FIRST_FAMILIES` checkpoint (Qwen3.5 as published) is a vision-language model that a run without images
trains as its language model alone; `images=True` (the run's prompts can carry images, as
`config.role_needs.carries_images` decides: `data.image_key`, or an endpoint way in with `agent.images=true`;
`RunFacts.vision`) makes it a vision-language model like the others. This module imports no torch: the config
checks read it before anything loads.
"""

from __future__ import annotations

from typing import Any

# the vision-language families whose image layout (`data.vision_family`, which reads this list) the data, the vision
# rollout engine and the trainer serve, each tested on a tiny random model of its architecture (`tiny_vlm`); another
# vision-language model is refused by name before it loads
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "qwen3_5", "smolvlm", "idefics3")
# published vision-language checkpoints whose language model trains alone, as a causal LM: transformers loads them
# with their text class (Qwen3.5's `qwen3_5` as `Qwen3_5ForCausalLM`, the vision tower left out), and the rollout
# engine reads the language model's weights, stored under `model.language_model.`, on the family's fast path
TEXT_FIRST_FAMILIES = ("qwen3_5",)
# where a vision-language model keeps its language model: Qwen's and Gemma 3's (`language_model`), SmolVLM's and
# Idefics3's (`text_model`)
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "model.text_model.")
# a vision-language model's tensors outside its language model: Qwen's tower (with its merger), Gemma 3's tower and
# the projector that feeds it to the language model, SmolVLM's tower and its connector
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "model.vision_model.",
                   "model.connector.")


def is_vision_config(config: Any, images: bool = False) -> bool:
    """Whether a transformers config is a vision-language model's (it has a `vision_config`) that trains as one: not
    a `TEXT_FIRST_FAMILIES` checkpoint, unless the run has `images`."""
    return getattr(config, "vision_config", None) is not None and \
        (images or getattr(config, "model_type", None) not in TEXT_FIRST_FAMILIES)


def text_view(config: Any, images: bool = False) -> Any:
    """A `TEXT_FIRST_FAMILIES` checkpoint's config, in a run without `images`, as its language model's
    (`get_text_config()`); any other config as it is."""
    if getattr(config, "model_type", None) in TEXT_FIRST_FAMILIES and not images:
        return config.get_text_config()
    return config


def language_model_name(name: str) -> str | None:
    """A checkpoint's tensor name as a text model names it: a vision-language model's language model
    (`model.language_model.x` -> `model.x`, as a `TEXT_FIRST_FAMILIES` checkpoint's, whose text class transformers
    also saves under those names; SmolVLM's `model.text_model.x`), None for what the text model leaves out (the
    vision tower, a multi-token-prediction head), any other name as it is."""
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return None if name.startswith(VISION_PREFIXES + ("mtp.",)) else name


def lm_auto_class(config: Any, images: bool = False) -> Any:
    """The Auto class of `config`'s model with its language-model head (in a run with or without `images`)."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vision_config(config, images) \
        else transformers.AutoModelForCausalLM


def config_fields(path: str | None) -> dict[str, Any] | None:
    """The fields of the config.json in directory `path`; None for a hub id, a missing directory or an unreadable
    file (the pre-load checks name a missing one)."""
    import json
    from pathlib import Path

    config = Path(str(path or "")) / "config.json"
    if not config.is_file():
        return None
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def vision_model_type(path: str | None, images: bool = False) -> str | None:
    """The model_type of the vision-language model in directory `path` (its config.json has a `vision_config`);
    None for a text model, a `TEXT_FIRST_FAMILIES` checkpoint in a run without `images`, a hub id or a missing
    directory (the pre-load checks name a missing one)."""
    fields = config_fields(path)
    if fields is not None and "vision_config" in fields and \
            (images or fields.get("model_type") not in TEXT_FIRST_FAMILIES):
        return str(fields.get("model_type"))
    return None
