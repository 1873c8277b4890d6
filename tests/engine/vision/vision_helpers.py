"""Prompts with images drawn by PIL, encoded for the tiny vision-language models (`tiny_vlm` fixture)."""

from __future__ import annotations

import io

from PIL import Image

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 230)}


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (60, 90)) -> bytes:
    """A PNG filled with `color`, as verl's parquet stores an image (`{"bytes": ...}`)."""
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def encoded_prompts(path):
    """(VisionPrompts, [(token ids, VisionInputs or None)]): one image, two images, and a prompt without one."""
    from transformers import AutoTokenizer

    from hybridflow.data.image_prompts import VisionPrompts

    prompts = VisionPrompts.from_pretrained(str(path), AutoTokenizer.from_pretrained(path))
    one = prompts.encode([{"role": "user", "content": "<image>Which color fills it?"}],
                         [{"bytes": png_bytes(COLORS["red"])}], "row 0")
    two = prompts.encode("Compare <image> with <image> please",
                         [{"bytes": png_bytes(COLORS["green"], (100, 60))}, {"bytes": png_bytes(COLORS["blue"], (56, 56))}],
                         "row 1")
    text = prompts.tokenizer("no image here")["input_ids"]
    return prompts, [one, two, (list(text), None)]
