"""Images in the endpoint's chat requests: OpenAI's `image_url` content parts, for a vision-language model's run.

    {"role": "user", "content": [{"type": "text", "text": "What is drawn here?"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}]}

`openai_wire.normalize_messages` turns such a content into text with the model's image mark where each image goes
(`vision_family`'s `chat_mark`, what the model's chat template makes of an image part: Qwen2.5-VL's and Qwen3-VL's
`<|vision_start|><|image_pad|><|vision_end|>`, Gemma 3's `<start_of_image>`, SmolVLM's `<image>`) and collects the
parts (`ImagePart`, checked there: a data URI or a `file://` URL; a remote URL is refused, since a run is offline and
its rollout must not wait on the network; a text model refuses every image part). The message keeps a digest of each
image's URL under `images`, so a later request continues it only when its images are the same ones.

`RequestImages` then decodes the parts (PIL), runs the model's image processor (`VisionPrompts.process`, the
dataset's own path) and replaces each mark by its image's text (`image_texts`), as the model's processor does: Qwen's
marks with one `<|image_pad|>` per merged patch, Gemma 3's `\\n\\n<start_of_image>`, its `mm_tokens_per_image`
soft tokens and `<end_of_image>\\n\\n`, SmolVLM's tiles and whole image. A continuation's new images are spliced
into its appended ids the same way (`slots`: each image's text tokenized alone, its margins with the text beside
it). An image that does not decode, or is over the processor's pixel limit, is refused 400 naming the message and
part.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any
from urllib.parse import unquote, urlparse

from hybridflow.agents.endpoint.openai_wire import APIError, ImagePart
from hybridflow.agents.loop.rendering import ImageSlots
from hybridflow.data.image_prompts import VisionInputs, VisionPrompts, decode_image


def read_image(part: ImagePart) -> Any:
    """The part's image as a PIL RGB image; APIError 400 naming the part when it does not decode."""
    source: Any
    if part.url.startswith("data:"):
        header, comma, payload = part.url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise APIError(400, f"{part.where}: a data URI must read data:image/<type>;base64,<data>",
                           param=part.where, code="invalid_image_url")
        try:
            source = {"bytes": base64.b64decode(payload, validate=True)}
        except binascii.Error as e:
            raise APIError(400, f"{part.where}: the data URI's base64 does not decode ({e})", param=part.where,
                           code="invalid_image") from None
    else:
        source = unquote(urlparse(part.url).path)
    try:
        return decode_image(source, part.where)
    except ValueError as e:
        raise APIError(400, str(e), param=part.where, code="invalid_image") from None


class RequestImages:
    """A vision-language model's images in endpoint requests (see the module docstring)."""

    def __init__(self, prompts: VisionPrompts) -> None:
        self.prompts = prompts
        self.mark = prompts.family.chat_mark(prompts.tokenizer)
        self.pad_id = prompts.family.image_token_id

    def load(self, parts: list[ImagePart]) -> VisionInputs | None:
        """The parts' pixel values and patch grids, in order (None for no parts)."""
        if not parts:
            return None
        loaded = []
        for part in parts:
            try:
                loaded.append(self.prompts.process([read_image(part)], part.where))
            except ValueError as e:  # over the processor's pixel limit, or a shape it refuses
                raise APIError(400, str(e), param=part.where, code="invalid_image") from None
        return VisionInputs.concat(loaded)

    def counts(self, vision: VisionInputs | None) -> list[int]:
        """The image tokens each image takes (Qwen: its patches merged; Gemma 3: `mm_tokens_per_image`; SmolVLM: its
        tiles' and its whole image's)."""
        return self.prompts.image_tokens(vision)

    def expand(self, text: str, vision: VisionInputs | None) -> str:
        """`text` with the i-th image mark replaced by image i's text (its image tokens between its marks)."""
        pieces, counts = text.split(self.mark), self.counts(vision)
        if len(pieces) - 1 != len(counts):
            raise APIError(400, f"the rendered messages hold {len(pieces) - 1} image marks for {len(counts)} images",
                           param="messages", code="invalid_value")
        return self.prompts.expand(pieces, vision)

    def slots(self, vision: VisionInputs | None) -> ImageSlots:
        """The images of a continuation's new messages as `TurnRenderer` splices them at their marks: each one's
        vision token ids, in order, and the plain text around them (what `expand` puts at a mark, tokenized). An
        image's text opens and closes with a special token, so alone it tokenizes as it does within the text."""
        tokenizer = self.prompts.tokenizer
        ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"])
               for text in self.prompts.family.image_texts(tokenizer, vision)]
        return ImageSlots(self.mark, ids, self.prompts.family.margins)
