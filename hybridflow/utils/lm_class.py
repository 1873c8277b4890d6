"""Which transformers Auto class builds a model with its language-model head: a vision-language model's
(`AutoModelForImageTextToText`: Qwen2.5-VL's vision tower, language model and head) or a causal LM's
(`AutoModelForCausalLM`). Every place that loads, sizes, checkpoints or exports the policy asks here, so a
vision-language model takes the same paths as a text one."""

from __future__ import annotations

from typing import Any


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def lm_auto_class(config: Any) -> Any:
    """The Auto class of `config`'s model with its language-model head."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vision_config(config) else transformers.AutoModelForCausalLM
