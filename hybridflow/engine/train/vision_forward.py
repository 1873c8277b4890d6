"""A vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5 with `images`, SmolVLM) in the training engine: its
vision tower, frozen or trained (`model.freeze_vision`), and the inputs of its forward: each row's images and its
multimodal rotary positions.

`vision_tower(model)` names the tower (the module built from the config's `vision_config`). With `freeze_vision` the
trainer trains the language model alone: a full fine-tune leaves the tower's weights without gradients or optimizer
state, and LoRA gives adapters to the language model's linear layers only (`lora.apply_lora`'s `skip`); without it
the tower trains too (LoRA: adapters on its linear layers as well).

The rows of a vision batch carry their images as `pixel_values` / `image_grid_thw` tensors (`VisionInputs.pad_rows`,
repeated with their prompt for its samples), so the actor's, the reference's and the update's forwards see the pixels
the rollout engine prefilled with. `vision_kwargs` turns a micro-batch's rows into the model's keyword arguments: the
images of its rows one after another, and the positions of the whole rows, prompt and response (`vision_family`:
Qwen's 3-D ones from the model's own `get_rope_index`; Gemma 3's plain ones and `token_type_ids`, its image tokens
attending to each other both ways; SmolVLM's plain ones, its rows' tiles one after another), what the rollout
engine's prefill and decode used, so log-probs agree with it and with a transformers forward
(tests/engine/vision/test_vision_forward.py). Vision rows run in the padded layout:
packed rows would need the multimodal positions and masks of several sequences in one row.

Gemma 3's multimodal projector lies outside its tower (`model.multi_modal_projector`): with `freeze_vision` the
tower is frozen and the projector trains with the language model in a full fine-tune (LoRA adapts linear layers, and
the projector has none, so under LoRA it stays as loaded). SmolVLM's connector (`model.connector`, the projection of
the pixel-shuffled patches) lies outside its tower too and trains the same way in a full fine-tune; LoRA adapts the
decoder layers' linear layers, not its, so under LoRA it stays as loaded as well.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.data.image_prompts import VISION_KEYS, VisionInputs
from hybridflow.data.vision_family import vision_family


def vision_tower(model: torch.nn.Module) -> str | None:
    """The qualified name of a vision-language model's vision tower (`model.visual` in Qwen2.5-VL and Qwen3-VL,
    `model.vision_tower` in Gemma 3, `model.vision_model` in SmolVLM); None for a text model."""
    vision_config = getattr(model.config, "vision_config", None)
    if vision_config is None:
        return None
    return next(name for name, module in model.named_modules() if getattr(module, "config", None) is vision_config)


def freeze_tower(model: torch.nn.Module, name: str) -> int:
    """Leave the module `name`'s weights out of training; returns how many parameters that froze."""
    tower = model.get_submodule(name)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def has_images(mb: dict[str, torch.Tensor]) -> bool:
    """Whether a micro-batch's rows carry images."""
    return VISION_KEYS[0] in mb


def vision_kwargs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, mb: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The pixels (in `dtype`), positions and masks of padded rows `input_ids` / `attention_mask` [B, L] (on the
    model's device) whose images are `mb`'s (`vision_family.forward_kwargs`)."""
    per_row = VisionInputs.unpad_rows(mb["pixel_values"], mb["image_grid_thw"])
    family = vision_family(model.config)
    have = ((input_ids == family.image_token_id) & attention_mask.bool()).sum(-1).tolist()
    for r, (count, images) in enumerate(zip(have, per_row)):
        want = family.token_count(images)
        if count != want:  # e.g. a response holding an image placeholder (the vision engine never samples one)
            raise ValueError(f"vision row {r}: {count} image tokens (id {family.image_token_id}) where its images "
                             f"make {want}; a response must not hold the image placeholder")
    rows = [v for v in per_row if v is not None]
    images = VisionInputs.concat(rows).to(input_ids.device, dtype) if rows else None
    return family.forward_kwargs(model, input_ids, attention_mask, images)[0]
