"""A SmolVLM's (and Idefics3's) prompt with images is what the model's own processor makes of the same chat
(`VisionPrompts.encode`, the dataset's path): the same token ids (each image cut into rows x cols tiles, each tile's
`<fake_token_around_image><row_r_col_c>` and `<image>` tokens, then the whole image's), the same pixels, with image
splitting on and off. Idefics3's processor runs whole; SmolVLM's own needs torchvision for its video processor (absent
here), so its image text is checked against its module's expansion of each image (`get_image_prompt_string`)."""

from __future__ import annotations

import pytest
from PIL import Image
from transformers import AutoTokenizer

from hybridflow.data.image_prompts import VisionPrompts

# cut into 3 rows x 2 columns and 1 row x 3 columns of tiles by the tiny processor (longest side resized to 96)
SIZES = ((60, 90), (100, 30))


def picture(size, channel):
    """A picture whose `channel` falls off from top to bottom: no tile equals itself turned or mirrored."""
    fall = Image.linear_gradient("L").resize(size)
    flat = Image.new("L", size, 90)
    return Image.merge("RGB", [fall if c == channel else flat for c in range(3)])


@pytest.mark.parametrize("splitting", [True, False])
@pytest.mark.parametrize("tiny_vlm", ["smolvlm", "idefics3"], indirect=True)
def test_prompt_ids_and_pixels_are_what_the_processor_makes(tiny_vlm, splitting):
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    prompts = VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer)
    prompts.image_processor.do_image_splitting = splitting
    family = prompts.family
    chat = [{"role": "user", "content": "<image>Which color fills it?\nAnd here:<image>"}]
    pictures = [picture(size, channel) for channel, size in enumerate(SIZES)]
    ids, vision = prompts.encode(chat, pictures, "row 0")

    processor = Idefics3Processor(prompts.image_processor, AutoTokenizer.from_pretrained(tiny_vlm),
                                  image_seq_len=family.tokens_per_tile)
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    theirs = processor(text=text, images=[pictures], return_tensors="pt")
    assert ids == theirs["input_ids"][0].tolist()
    assert family.pixel_kwargs(vision)["pixel_values"].equal(theirs["pixel_values"])
    assert theirs["pixel_attention_mask"].all()  # square tiles: the mask the forward leaves out is all ones
    assert vision.image_grid_thw[:, 3:].tolist() == ([[3, 2], [1, 3]] if splitting else [[0, 0], [0, 0]])
    assert ids.count(family.image_token_id) == family.token_count(vision) == (11 if splitting else 2) * 4
    if "smolvlm" in str(tiny_vlm):
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        tiles = prompts.image_processor(images=pictures, return_row_col_info=True)
        written = [get_image_prompt_string(rows, cols, family.tokens_per_tile, "<fake_token_around_image>",
                                           "<image>", "<global-img>")
                   for rows, cols in zip(tiles["rows"][0], tiles["cols"][0])]
        assert family.image_texts(tokenizer, vision) == written


@pytest.mark.parametrize("tiny_vlm", ["smolvlm"], indirect=True)
def test_a_published_template_gets_the_prompt_as_parts_and_writes_the_image_marks(tiny_vlm):
    """SmolVLM's chat template as published reads contents only as parts: verl's `<image>` placeholders become image
    parts between the text parts, and the ids and pixels are what the processor makes of the parts-form chat."""
    from parts_templates import SMOLVLM
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    tokenizer.chat_template = SMOLVLM
    # a token of the published vocabulary, which the tiny one lacks and `Idefics3Processor` adds to its tokenizer
    tokenizer.add_tokens(["<end_of_utterance>"], special_tokens=True)
    prompts = VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer)
    chat = [{"role": "user", "content": "<image>Which color fills it?\nAnd here:<image>"}]
    pictures = [picture(size, channel) for channel, size in enumerate(SIZES)]
    ids, vision = prompts.encode(chat, pictures, "row 0")

    question = {"type": "text", "text": "Which color fills it?\nAnd here:"}
    parts = [{"role": "user", "content": [{"type": "image"}, question, {"type": "image"}]}]  # the processor's own form
    text = tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>User:<image>Which color fills it?\nAnd here:<image><end_of_utterance>\nAssistant:"
    processor = Idefics3Processor(prompts.image_processor, AutoTokenizer.from_pretrained(tiny_vlm),
                                  image_seq_len=prompts.family.tokens_per_tile)
    theirs = processor(text=text, images=[pictures], return_tensors="pt")
    assert ids == theirs["input_ids"][0].tolist()
    assert prompts.family.pixel_kwargs(vision)["pixel_values"].equal(theirs["pixel_values"])


@pytest.mark.parametrize("tiny_vlm", ["gemma3"], indirect=True)
def test_a_parts_template_writes_the_familys_own_image_mark(tiny_vlm):
    """A template that reads parts writes an image part as the family's mark (Gemma 3's `<start_of_image>`), not as
    verl's `<image>`: each becomes the image's soft tokens, the text around them kept."""
    from parts_templates import GEMMA3_PARTS

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    tokenizer.chat_template = GEMMA3_PARTS
    prompts = VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer)
    chat = [{"role": "user", "content": "<image>Which color fills it?\nAnd here:<image>"}]
    ids, vision = prompts.encode(chat, [picture(size, channel) for channel, size in enumerate(SIZES)], "row 0")
    assert ids.count(prompts.family.image_token_id) == prompts.family.token_count(vision) == 2 * 4
    assert "Which color fills it?\nAnd here:" in tokenizer.decode(ids)
