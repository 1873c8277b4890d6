"""Images in prompts for vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3, SmolVLM): verl's geo3k layout
to token ids and pixel values.

A row holds its images under `data.image_key` (verl's `images` column): a list whose items are `{"bytes": ...}`
mappings (as verl's parquet stores them), `{"path": ...}` mappings, path strings, raw bytes or PIL images. Its
prompt says `<image>` where each image goes, in order. `VisionPrompts.encode` renders the prompt as text prompts are
(`chat.render_prompt`; a chat template that reads contents as parts, SmolVLM's as published, gets each `<image>` as an
image part and writes the family's `chat_mark` for it), puts the model's vision tokens at each image (Qwen's
`<|vision_start|>`, one `<|image_pad|>` per merged patch, `<|vision_end|>`; Gemma 3's `<start_of_image>`, its soft
tokens and `<end_of_image>`; SmolVLM's tiles, each `<fake_token_around_image>`, its row and column and its `<image>`
tokens, then the whole image's: what each family's processor makes of an image part, `vision_family`), and runs the
model's image processor (transformers', its PIL backend where torchvision is absent) for the pixel values.

Every image is decoded and checked when the dataset is built; an image that does not decode, a prompt whose
`<image>` count differs from its images, or an image over the processor's pixel limit (`max_pixels`) is refused
there, with the file, row and image named, never mid-run.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.utils.lm_class import VISION_FAMILIES, is_vision_config

IMAGE_PLACEHOLDER = "<image>"
# the batch tensors that carry each row's images (`VisionInputs.pad_rows`): a prompt batch's, and the RL rows made
# from it (repeated with their prompt), so the rollout and the trainer's forwards read the same pixels
VISION_KEYS = ("pixel_values", "image_grid_thw")


@dataclass
class VisionInputs:
    """One prompt's processed images: `pixel_values` [patches, D] (Qwen's: the image processor's flattened patches,
    channels x temporal x patch x patch; Gemma 3's and SmolVLM's: a pixel's channels; the images one after another)
    and `image_grid_thw` [images, 3 or more] long: each image's grid of patches in time, height and width, whose
    product is its rows of `pixel_values`, and the columns its family adds (SmolVLM: its tiles' rows and columns,
    which its text names; `vision_family`)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @staticmethod
    def concat(items: list[VisionInputs]) -> VisionInputs:
        """The images of several prompts, one after another (the model's batched layout)."""
        return VisionInputs(torch.cat([v.pixel_values for v in items]), torch.cat([v.image_grid_thw for v in items]))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VisionInputs:
        return VisionInputs(self.pixel_values.to(device, dtype), self.image_grid_thw.to(device))

    @staticmethod
    def pad_rows(rows: list[VisionInputs | None]) -> dict[str, torch.Tensor]:
        """Per-row images as batch tensors: `pixel_values` [B, most patches, D] and `image_grid_thw` [B, most images,
        its columns], zero-padded (a zero grid is no image), so row operations (select, repeat, split) carry them."""
        present = [v for v in rows if v is not None]
        if not present:
            raise ValueError("no row has images; a vision batch needs at least one")
        width, dim = max(v.pixel_values.shape[0] for v in present), present[0].pixel_values.shape[1]
        images = max(v.image_grid_thw.shape[0] for v in present)
        pixels = torch.zeros(len(rows), width, dim, dtype=present[0].pixel_values.dtype)
        grid = torch.zeros(len(rows), images, present[0].image_grid_thw.shape[1], dtype=torch.long)
        for r, v in enumerate(rows):
            if v is not None:
                pixels[r, :v.pixel_values.shape[0]] = v.pixel_values
                grid[r, :v.image_grid_thw.shape[0]] = v.image_grid_thw
        return {"pixel_values": pixels, "image_grid_thw": grid}

    @staticmethod
    def unpad_rows(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[VisionInputs | None]:
        """`pad_rows`' inverse: each row's images (None for a row without)."""
        out: list[VisionInputs | None] = []
        for pixels, grid in zip(pixel_values, image_grid_thw):
            patches = grid[:, :3].prod(-1)
            grid = grid[patches > 0]
            out.append(VisionInputs(pixels[:int(patches.sum())], grid) if len(grid) else None)
        return out


def decode_image(value: Any, where: str):
    """A PIL RGB image from one item of an `images` column; ValueError naming `where` when it does not decode."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    source: Any = value
    if isinstance(value, dict):
        source = value.get("bytes") if value.get("bytes") is not None else value.get("path")
        if source is None:
            raise ValueError(f"{where}: expected an image as {{'bytes': ...}} or {{'path': ...}}, got keys "
                             f"{sorted(value)}")
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise ValueError(f"{where}: image file {str(source)!r} does not exist")
    else:
        raise ValueError(f"{where}: expected image bytes, a path or a {{'bytes': ...}} mapping, got "
                         f"{type(value).__name__}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")  # reads the whole image: a truncated file fails here, not mid-run
    except (UnidentifiedImageError, OSError, SyntaxError) as e:  # PIL raises SyntaxError for some corrupt headers
        raise ValueError(f"{where}: the image does not decode ({type(e).__name__}: {e})") from None


class VisionPrompts:
    """A VLM's tokenizer and image processor: prompts with `<image>` and their images -> (token ids, `VisionInputs`).

    Build it with `from_pretrained(model_path, tokenizer)`; `encode(prompt, images, where)` raises ValueError
    naming `where` (a file and row) for bad input."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any) -> None:
        from hybridflow.data.vision_family import vision_family  # it builds this module's VisionInputs

        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.family = vision_family(config)
        self.pad = tokenizer.convert_ids_to_tokens(self.family.image_token_id)  # the image token's string
        self.max_pixels = self.family.pixel_limit(image_processor)

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Any) -> VisionPrompts:
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path)
        if not is_vision_config(config, images=True):
            raise ValueError(f"{path}: model_type {config.model_type!r} is not a vision-language model (no "
                             f"vision_config); data.image_key needs one of {', '.join(VISION_FAMILIES)}")
        return cls(tokenizer, AutoImageProcessor.from_pretrained(path), config)

    def process(self, images: list, where: str) -> VisionInputs:
        """Decoded, size-checked images -> their pixel values and patch grids."""
        for i, image in enumerate(images):
            pixels = image.width * image.height
            if self.max_pixels is not None and pixels > self.max_pixels:
                raise ValueError(f"{where}, image {i}: {image.width}x{image.height} = {pixels} pixels, over the "
                                 f"image processor's limit of {self.max_pixels} (max_pixels); downscale the image "
                                 f"or raise max_pixels in the model's preprocessor_config.json")
        try:
            out = self.image_processor(images=images, return_tensors="pt", **self.family.process_kwargs)
        except ValueError as e:  # e.g. an aspect ratio past the processor's bound
            raise ValueError(f"{where}: the image processor refused an image: {e}") from None
        return self.family.image_inputs(out, where)

    def image_tokens(self, vision: VisionInputs | None) -> list[int]:
        """The language-model tokens each image of `vision` takes ([] for None)."""
        return self.family.image_tokens(vision)

    def expand(self, pieces: list[str], vision: VisionInputs | None) -> str:
        """The text of `pieces` (split where each image goes, one more piece than images) with image i's text
        (`vision_family`'s `image_texts`, within its `margins`) between piece i and piece i + 1."""
        before, after = self.family.margins
        return pieces[0] + "".join(before + text + after + piece
                                   for text, piece in zip(self.family.image_texts(self.tokenizer, vision), pieces[1:]))

    def encode(self, prompt: Any, images: Any, where: str, apply_chat_template: bool = True
               ) -> tuple[list[int], VisionInputs]:
        """Token ids of the rendered prompt (each `<image>` expanded to its vision tokens) and its images."""
        from hybridflow.data.chat import as_messages, reads_parts, render_prompt

        if not isinstance(images, (list, tuple)) or not images:
            raise ValueError(f"{where}: expected a non-empty list of images, got {images!r:.80}")
        decoded = [decode_image(v, f"{where}, image {i}") for i, v in enumerate(images)]
        templated = as_messages(prompt, self.tokenizer, apply_chat_template) is not None
        text = render_prompt(prompt, self.tokenizer, apply_chat_template, image_mark=IMAGE_PLACEHOLDER)
        # a template that reads parts got each `<image>` as an image part and wrote its own mark for it
        mark = self.family.chat_mark(self.tokenizer) if templated and reads_parts(self.tokenizer) else IMAGE_PLACEHOLDER
        pieces = text.split(mark)
        if len(pieces) - 1 != len(decoded):
            raise ValueError(f"{where}: the prompt has {len(pieces) - 1} '{IMAGE_PLACEHOLDER}' placeholder(s) for "
                             f"{len(decoded)} image(s); each image needs one '{IMAGE_PLACEHOLDER}' where it goes")
        vision = self.process(decoded, where)
        text = self.expand(pieces, vision)
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        return list(ids), vision
