"""What differs between the vision-language families the data, the vision rollout engine and the trainer serve: how an
image appears in a prompt's text, how its pixels travel with a row, and the positions and masks of a forward.

    family = vision_family(config)                     # Qwen's (`VisionFamily`), Gemma 3's, SmolVLM's
    family.image_texts(tokenizer, images)              # the text each image of a `VisionInputs` becomes
    family.chat_mark(tokenizer)                        # what the chat template makes of an image part
    family.image_inputs(processed, where)              # the image processor's output -> `VisionInputs`
    kwargs, deltas = family.forward_kwargs(model, ids, mask, images)   # a padded forward's positions, masks, pixels

An image's text (`image_texts`) opens and closes with a special token, so it tokenizes alone as it does within a
prompt (the endpoint splices its ids into a continuation that way); plain text the processor puts around it is the
family's `margins`, tokenized with the text beside it. Each image's row of `VisionInputs.image_grid_thw` is what its
text and its pixels need: its first three columns count its rows of `pixel_values`, a family may add more.

- **Qwen2.5-VL, Qwen3-VL, Qwen3.5** (`VisionFamily`): an image is `<|vision_start|>`, one `<|image_pad|>` per merged
  patch (its size decides how many) and `<|vision_end|>` (the chat template writes an image part as the three marks
  with one pad, which the processor widens); its pixels are the processor's flattened patches and their grid
  (`image_grid_thw`); a forward takes the 3-D multimodal rotary positions of `get_rope_index`, whose rope delta
  (text after an image continues from the image's largest position) shifts each decoded token's rotation.
- **Gemma 3** (`Gemma3Family`, `Gemma3ForConditionalGeneration`): an image is `\\n\\n<start_of_image>`,
  `mm_tokens_per_image` `<image_soft_token>`s (256 in the released models, whatever its size: the processor
  resizes it to the tower's square) and `<end_of_image>\\n\\n` (its `margins`: plain text), what Gemma 3's
  processor makes of the `<start_of_image>` its chat template writes for an image part. Its pixels travel in
  `VisionInputs`' row layout as one row per pixel (its channels), the grid `[1, side, side]`, and go back to
  `[images, channels, side, side]` for the forward. Positions are plain 1-D (no rope delta); the forward takes
  `token_type_ids` (1 on image tokens), from which transformers lets an image's tokens attend to each other both
  ways in the prefill. Pan and scan (extra crops per image) is refused by name.
- **SmolVLM, Idefics3** (`SmolVLMFamily`: `SmolVLMForConditionalGeneration`, and its parent
  `Idefics3ForConditionalGeneration`, one layout): the image processor cuts an image into rows x cols square tiles
  of the tower's side plus the whole image shrunk to one tile (no cut, rows = cols = 0, when it fits one tile), and
  the image becomes, as its processor writes it for the `<image>` its chat template writes for an image part: per
  tile `<fake_token_around_image><row_r_col_c>` and the tile's `<image>` tokens (the tower's patches,
  pixel-shuffled: the model's `image_seq_len`), a newline after each row of tiles, then
  `\\n<fake_token_around_image><global-img>`, the whole image's tokens and `<fake_token_around_image>`. Its tiles
  travel as Gemma 3's images do (one row per pixel), the grid `[tiles, side, side, rows, cols]` (the last two for
  its text), and go back to `[1, tiles, channels, side, side]` for the forward (the model encodes every tile and
  scatters their features over the `<image>` tokens in order). Positions are plain 1-D, no rope delta, no token
  types.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.data.image_prompts import VisionInputs
from hybridflow.utils.lm_class import VISION_FAMILIES


class VisionFamily:
    """A vision-language family's image layout, as Qwen2.5-VL, Qwen3-VL and Qwen3.5 have it (see the module
    docstring); the other families (`Gemma3Family`, `SmolVLMFamily`) override what differs."""

    rope_delta = True  # decoded tokens rotate at their index plus the prompt's delta
    # plain text the processor puts before and after an image's text: text, not special tokens, so a tokenizer
    # reads it together with the text beside the image (the endpoint's spliced ids encode it with that text)
    margins = ("", "")
    # the image processor's keyword arguments beside the images (what `image_inputs` reads of its output)
    process_kwargs: dict[str, Any] = {}

    def __init__(self, config: Any) -> None:
        self.config = config
        self.image_token_id = int(config.image_token_id)
        # never sampled: the image and video placeholders (a response's would be taken for an image position)
        self.placeholders = sorted({self.image_token_id, int(getattr(config, "video_token_id", self.image_token_id))})

    def marks(self) -> tuple[int, int, int]:
        """The ids an image's text opens with, repeats per token and closes with."""
        return self.config.vision_start_token_id, self.image_token_id, self.config.vision_end_token_id

    def image_texts(self, tokenizer: Any, images: VisionInputs | None) -> list[str]:
        """The text each image of `images` becomes between the `margins` ([] for None), in the strings of
        `tokenizer`'s special tokens."""
        start, pad, end = tokenizer.convert_ids_to_tokens(list(self.marks()))
        return [start + pad * n + end for n in self.image_tokens(images)]

    def chat_mark(self, tokenizer: Any) -> str:
        """What the chat template writes for one image part, which `image_texts` replaces (the processor's way)."""
        return "".join(tokenizer.convert_ids_to_tokens(list(self.marks())))

    def pixel_limit(self, image_processor: Any) -> int | None:
        """The most pixels the image processor takes in one image (Qwen's `max_pixels`), None for no limit."""
        size = getattr(image_processor, "size", None) or {}
        limit = getattr(image_processor, "max_pixels", None) or size.get("longest_edge")
        return int(limit) if limit else None

    def image_tokens(self, images: VisionInputs | None) -> list[int]:
        """The language-model tokens each image of `images` takes ([] for None): its patches, merged."""
        if images is None:
            return []
        return (images.image_grid_thw.prod(-1) // self.config.vision_config.spatial_merge_size ** 2).tolist()

    def token_count(self, images: VisionInputs | None) -> int:
        return sum(self.image_tokens(images))

    def image_inputs(self, processed: Any, where: str) -> VisionInputs:
        """The image processor's output as `VisionInputs`."""
        return VisionInputs(processed["pixel_values"], processed["image_grid_thw"].long())

    def pixel_kwargs(self, images: VisionInputs) -> dict[str, torch.Tensor]:
        """The keyword arguments of a transformers forward that carry `images`."""
        return {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw}

    def model_inputs(self, ids: torch.Tensor, images: VisionInputs | None) -> dict[str, torch.Tensor]:
        """What a plain transformers forward or `generate` of the rows `ids` takes beside them (positions left to
        transformers): the image tokens' types and the pixels."""
        return {"mm_token_type_ids": (ids == self.image_token_id).int(),
                **(self.pixel_kwargs(images) if images is not None else {})}

    def forward_kwargs(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, images: VisionInputs | None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(The keyword arguments of a forward of padded rows `ids` / `mask` [B, L] whose images, one row's after
        another, are `images`: positions, pixels; each row's rope delta [B])."""
        grid = images.image_grid_thw if images is not None else None
        positions, deltas = model.model.get_rope_index(ids, (ids == self.image_token_id).int(), grid,
                                                       attention_mask=mask)
        kwargs = {"position_ids": positions, **(self.pixel_kwargs(images) if images is not None else {})}
        return kwargs, deltas[:, 0]


class Gemma3Family(VisionFamily):
    """Gemma 3's image layout (see the module docstring)."""

    rope_delta = False
    margins = ("\n\n", "\n\n")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.tokens_per_image = int(config.mm_tokens_per_image)

    def marks(self) -> tuple[int, int, int]:
        return self.config.boi_token_id, self.image_token_id, self.config.eoi_token_id

    def chat_mark(self, tokenizer: Any) -> str:
        return tokenizer.convert_ids_to_tokens(self.config.boi_token_id)

    def image_tokens(self, images: VisionInputs | None) -> list[int]:
        return [] if images is None else [self.tokens_per_image] * len(images.image_grid_thw)

    def image_inputs(self, processed: Any, where: str) -> VisionInputs:
        crops = processed.get("num_crops")
        if crops is not None and any(int(c) for c in torch.as_tensor(crops).reshape(-1)):
            raise ValueError(f"{where}: the image processor cut crops from an image (do_pan_and_scan); Gemma 3's "
                             f"pan and scan is not served here: set do_pan_and_scan false in the model's "
                             f"preprocessor_config.json")
        pixels = processed["pixel_values"]  # [images, channels, side, side]
        side = pixels.shape[-1]
        return VisionInputs(pixel_rows(pixels), torch.tensor([[1, side, side]] * pixels.shape[0]))

    def pixel_kwargs(self, images: VisionInputs) -> dict[str, torch.Tensor]:
        return {"pixel_values": square_tiles(images)}

    def model_inputs(self, ids: torch.Tensor, images: VisionInputs | None) -> dict[str, torch.Tensor]:
        return {"token_type_ids": (ids == self.image_token_id).long(),
                **(self.pixel_kwargs(images) if images is not None else {})}

    def forward_kwargs(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, images: VisionInputs | None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        kwargs = {"position_ids": plain_positions(mask),
                  "token_type_ids": ((ids == self.image_token_id) & mask.bool()).long(),
                  **(self.pixel_kwargs(images) if images is not None else {})}
        return kwargs, torch.zeros(len(ids), dtype=torch.long, device=ids.device)


class SmolVLMFamily(VisionFamily):
    """SmolVLM's and Idefics3's image layout (see the module docstring)."""

    rope_delta = False
    process_kwargs = {"return_row_col_info": True}  # each image's rows and columns of tiles, which its text names

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        vision = config.vision_config
        # one tile's tokens: the tower's patches, pixel-shuffled by scale_factor (the model's `image_seq_len`)
        self.tokens_per_tile = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2

    def chat_mark(self, tokenizer: Any) -> str:
        return tokenizer.convert_ids_to_tokens(self.image_token_id)

    def image_texts(self, tokenizer: Any, images: VisionInputs | None) -> list[str]:
        # the tokenizer's names for the marks where it has them, else the processor's defaults (as it reads them)
        around = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
        whole = getattr(tokenizer, "global_image_token", None) or "<global-img>"
        run = tokenizer.convert_ids_to_tokens(self.image_token_id) * self.tokens_per_tile
        texts = []
        for rows, cols in ([] if images is None else images.image_grid_thw[:, 3:].tolist()):
            tiles = "".join("".join(f"{around}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                            for r in range(rows))
            texts.append(tiles + ("\n" if rows else "") + around + whole + run + around)
        return texts

    def pixel_limit(self, image_processor: Any) -> int | None:
        # the processor resizes every image to fit its `size`, whose `longest_edge` is a side, not Qwen's pixel count
        return None

    def image_tokens(self, images: VisionInputs | None) -> list[int]:
        return [] if images is None else (images.image_grid_thw[:, 0] * self.tokens_per_tile).tolist()

    def image_inputs(self, processed: Any, where: str) -> VisionInputs:
        # one prompt's images, their tiles in order, each the tower's square: its `pixel_attention_mask` is all ones
        tiles = processed["pixel_values"][0]  # [tiles, channels, side, side]
        side = tiles.shape[-1]
        grid = [[rows * cols + 1, side, side, rows, cols] for rows, cols in zip(processed["rows"][0],
                                                                                processed["cols"][0])]
        return VisionInputs(pixel_rows(tiles), torch.tensor(grid))

    def pixel_kwargs(self, images: VisionInputs) -> dict[str, torch.Tensor]:
        return {"pixel_values": square_tiles(images)[None]}

    def model_inputs(self, ids: torch.Tensor, images: VisionInputs | None) -> dict[str, torch.Tensor]:
        return self.pixel_kwargs(images) if images is not None else {}

    def forward_kwargs(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, images: VisionInputs | None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        kwargs = {"position_ids": plain_positions(mask), **(self.pixel_kwargs(images) if images is not None else {})}
        return kwargs, torch.zeros(len(ids), dtype=torch.long, device=ids.device)


def plain_positions(mask: torch.Tensor) -> torch.Tensor:
    """Left- or right-padded rows' 1-D positions: each real token's index among its row's real tokens."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pixel_rows(tiles: torch.Tensor) -> torch.Tensor:
    """Square images or tiles [N, channels, side, side] as `VisionInputs` rows: one per pixel, its channels."""
    count, channels, side = tiles.shape[0], tiles.shape[1], tiles.shape[-1]
    return tiles.reshape(count, channels, side * side).transpose(1, 2).reshape(-1, channels)


def square_tiles(images: VisionInputs) -> torch.Tensor:
    """`pixel_rows`' inverse: [N, channels, side, side], N the squares the grid's first column counts."""
    count, side = int(images.image_grid_thw[:, 0].sum()), int(images.image_grid_thw[0, 1])
    channels = images.pixel_values.shape[-1]
    pixels = images.pixel_values.reshape(count, side * side, channels).transpose(1, 2)
    return pixels.reshape(count, channels, side, side)


# the families of `lm_class.VISION_FAMILIES` (the one list of them, importable without torch) whose layout is not
# Qwen's
OTHER_LAYOUTS: dict[str, type[VisionFamily]] = {"gemma3": Gemma3Family, "smolvlm": SmolVLMFamily,
                                                "idefics3": SmolVLMFamily}


def vision_family(config: Any) -> VisionFamily:
    """The image layout of a vision-language model of `config`; ValueError naming its model_type otherwise."""
    model_type = str(getattr(config, "model_type", None))
    if model_type not in VISION_FAMILIES:
        raise ValueError(f"model_type {model_type!r} has no vision path here; vision families: "
                         f"{', '.join(VISION_FAMILIES)}")
    return OTHER_LAYOUTS.get(model_type, VisionFamily)(config)
