"""Images through the OpenAI-compatible endpoint (tiny random Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5 and SmolVLM's
engines, the real `openai` client): `image_url` parts reach the vision engine with their prompt as the family's
processor writes them, a continuation's new image joins the re-prefilled sequence, and the trainer's forward of the
stitched row gives the log-probs that were sampled; bad images, remote URLs, forged image marks and tokens and images
sent to a text model are 400s naming what is wrong."""

from __future__ import annotations

import asyncio
import base64
import io

import openai
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from endpoint_helpers import ScriptedDriver, client, serving
from hybridflow.agents.endpoint.image_parts import RequestImages
from hybridflow.agents.endpoint.openai_wire import ImagePart
from hybridflow.agents.endpoint.vision_driver import VisionDriver
from hybridflow.batch import Batch
from hybridflow.data.image_prompts import VisionInputs, VisionPrompts
from hybridflow.engine.rollout import SamplingParams
from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine
from hybridflow.workers.rollout_layout import completions_to_batch


def data_uri(color, size=(60, 90)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vlm(tiny_vlm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [tokenizer.eos_token_id], 8, 512)
    return tiny_vlm, tokenizer, engine, RequestImages(VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer))


def run(vlm, params, talk):
    """`talk(api, endpoint)` against the VLM's endpoint; returns (its result, the endpoint)."""
    _, tokenizer, engine, images = vlm

    async def main():
        async with serving(tokenizer, VisionDriver(engine, params), params, budget=120, max_prompt_length=300,
                           images=images) as (endpoint, port):
            endpoint.open("k")
            return await talk(client(port, "k"), endpoint), endpoint

    return asyncio.run(main())


@pytest.mark.parametrize("with_images", [True, False])
def test_images_reach_the_engine_and_the_trainer_sees_the_sampled_log_probs(vlm, with_images):
    """Turn 1 sends an image, turn 2 continues with a second one: the trajectory is prompt, answer, the new message
    with its image's tokens, answer; its images are both, in token order; the tower encoded them once per turn's
    prefill (re-prefilled: 1, then 2); the trainer's forward of the row gives the sampled log-probs. Without images
    (a VLM's text-only conversation) the row has no pixels and the log-probs agree as well."""
    from hybridflow.config.model_schema import FrozenModelConfig
    from hybridflow.engine.train.engine import TrainEngine

    path, tokenizer, engine, images = vlm
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11)  # no family samples a special token mid-turn
    colors = [((220, 30, 30), (60, 90)), ((30, 40, 230), (56, 112))]
    pictures = [image_part(data_uri(*color)) for color in colors]
    if not with_images:
        pictures = [{"type": "text", "text": " (no picture)"}] * 2
    first = [{"role": "user", "content": [{"type": "text", "text": "Which color?"}, pictures[0]]}]

    async def talk(api, endpoint):
        one = await api.chat.completions.create(model="policy", messages=first, logprobs=True)
        second = [pictures[1], {"type": "text", "text": "And this?"}]
        follow = [*first, one.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": second}]
        two = await api.chat.completions.create(model="policy", messages=follow, logprobs=True)
        return one, two

    before = engine.encoded_images
    (one, two), endpoint = run(vlm, params, talk)
    trajectory = endpoint.lanes["k"].finish(endpoint.renderers)
    assert one.choices[0].message.content is not None and two.choices[0].model_extra["token_ids"]
    assert engine.encoded_images - before == (3 if with_images else 0)
    assert trajectory.segments == 1 and trajectory.turns == 2 and trajectory.token_mismatch == 0
    assert trajectory.kv_reused_tokens == 0  # each turn re-prefilled the conversation
    counts = images.counts(trajectory.vision)
    assert len(counts) == (2 if with_images else 0)
    image_id = images.pad_id
    mask, ids = trajectory.response_mask, trajectory.token_ids
    context = [t for t, m in zip(ids, mask) if m == 0]
    assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
    if with_images:  # both images, in order, each as the family's processor writes it (Gemma 3: blank lines around)
        sent = images.prompts.process([Image.new("RGB", size, color) for color, size in colors], "sent")
        assert trajectory.vision.pixel_values.equal(sent.pixel_values)
        assert trajectory.vision.image_grid_thw.equal(sent.image_grid_thw)
        assert trajectory.prompt_ids.count(image_id) == counts[0] and context.count(image_id) == counts[1]
        written = images.prompts.family.image_texts(tokenizer, trajectory.vision)
        for part, text in zip((trajectory.prompt_ids, context), written):
            assert text in tokenizer.decode(part, skip_special_tokens=False)

    batch = Batch({"prompts": torch.zeros(1, 1, dtype=torch.long),
                   "attention_mask": torch.ones(1, 1, dtype=torch.long)})
    rows = completions_to_batch(batch, [[trajectory]], 1, len(ids), pad_id=0, prompt_width=300)
    if with_images:
        assert rows["image_grid_thw"].tolist() == [trajectory.vision.image_grid_thw.tolist()]
        assert VisionInputs.unpad_rows(rows["pixel_values"], rows["image_grid_thw"])[0].pixel_values.equal(
            trajectory.vision.pixel_values)
    else:
        assert "pixel_values" not in rows
    trainer = TrainEngine(FrozenModelConfig(path=str(path), dtype="fp32"), device=torch.device("cpu"), images=True)
    ours = trainer.infer(rows.tensors, micro_batch_size=1)["log_probs"][0]
    model = torch.tensor(mask).bool()
    sampled = [t.logprob for t in one.choices[0].logprobs.content + two.choices[0].logprobs.content]
    assert torch.tensor(trajectory.logprobs)[model].tolist() == pytest.approx(sampled)
    assert torch.allclose(ours[model], torch.tensor(sampled), atol=1e-4)


def test_the_pages_image_agent_runs(vlm, tmp_path):
    """docs/agents.md's `look_agent.py` sends its row's picture and is answered about it."""
    from hybridflow.agents.endpoint.runner_child import load_runner
    from test_docs_examples import examples

    (tmp_path / "look_agent.py").write_text(examples()["look_agent.py"])
    (tmp_path / "red.png").write_bytes(png((56, 84), (220, 30, 30)))
    row = {"extra_info": {"image_path": str(tmp_path / "red.png")}, "ground_truth": "red"}
    look = load_runner(f"{tmp_path}/look_agent.py:look")
    reward, endpoint = run(vlm, SamplingParams(temperature=1.0, max_tokens=4),
                           lambda api, endpoint: look(api, row))
    trajectory = endpoint.lanes["k"].trajectory
    grid = endpoint.renderers.images.prompts.process([Image.new("RGB", (56, 84))], "red").image_grid_thw
    assert reward in (0.0, 1.0) and trajectory.turns == 0 and trajectory.vision.image_grid_thw.equal(grid)


def png(size, fill=(0, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, fill).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("part,match", [
    (image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode()),
     r"messages\[0\]\.content\[1\], image 0|messages\[0\]\.content\[1\]: the image does not decode"),
    (image_part("data:image/png;base64,%%%"), r"messages\[0\]\.content\[1\]: the data URI's base64 does not decode"),
    (image_part("https://example.com/cat.png"), r"messages\[0\]\.content\[1\]: only data: URIs and file:// URLs are "
                                                r"read \(the run is offline"),
    (image_part("file:///no/such/image.png"), r"messages\[0\]\.content\[1\]: image file '/no/such/image.png' does not"),
    (image_part("data:image/png;base64," + base64.b64encode(png((2000, 2000))).decode()),
     r"messages\[0\]\.content\[1\], image 0: 2000x2000 = 4000000 pixels, over the image processor's limit"),
    ({"type": "text", "text": "{pad}"},
     r"the prompt has \d+ image tokens where its images make \d+: a text must not write the image token"),
    ({"type": "text", "text": "{mark}"}, r"the rendered messages hold 2 image marks for 1 images"),
])
def test_bad_images_are_refused_naming_the_part(vlm, part, match):
    images = vlm[3]
    if "over the image processor's limit" in match and images.prompts.max_pixels is None:
        pytest.skip("Gemma 3's processor resizes every image to the tower's square: no pixel limit to pass")
    if part["type"] == "text":  # the family's own image token, or what its chat template writes for an image part
        if part["text"] == "{pad}" and images.prompts.pad == images.mark:  # SmolVLM's image token is its image mark
            match = r"the rendered messages hold 2 image marks for 1 images"
        part = {"type": "text", "text": part["text"].format(pad=images.prompts.pad, mark=images.mark)}
    params = SamplingParams(temperature=1.0, max_tokens=4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part,
                                             image_part(data_uri((30, 200, 40)))]}]

    async def talk(api, endpoint):
        with pytest.raises(openai.BadRequestError, match=match) as refused:
            await api.chat.completions.create(model="policy", messages=messages)
        return refused.value

    error, endpoint = run(vlm, params, talk)
    assert error.status_code == 400 and endpoint.stats["errors"] == 1
    assert endpoint.lanes["k"].trajectory.prompt_ids is None  # nothing of a refused request is kept


def test_a_completion_continued_with_the_image_token_is_refused(vlm):
    """A raw completion's text that writes the image token is refused 400 (the engine would fail the phase on an
    image position without pixels), first request or continuation alike."""
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=0)
    pad = vlm[3].prompts.pad

    async def talk(api, endpoint):
        first = await api.completions.create(model="policy", prompt="Say a color:")
        with pytest.raises(openai.BadRequestError, match=r"has 1 image tokens where its images make 0"):
            await api.completions.create(model="policy", prompt="Say a color:" + first.choices[0].text + pad)
        with pytest.raises(openai.BadRequestError, match=r"the prompt has 1 image tokens where its images make 0"):
            await api.completions.create(model="policy", prompt=f"{pad} again")
        return first

    first, endpoint = run(vlm, params, talk)
    assert first.choices[0].model_extra["token_ids"] and endpoint.stats["errors"] == 2


def test_a_file_url_is_read(vlm, tmp_path):
    (tmp_path / "green.png").write_bytes(png((56, 56), (30, 200, 40)))
    params = SamplingParams(temperature=1.0, max_tokens=3)
    messages = [{"role": "user", "content": [image_part(f"file://{tmp_path}/green.png")]}]

    async def talk(api, endpoint):
        return await api.chat.completions.create(model="policy", messages=messages)

    _, endpoint = run(vlm, params, talk)
    sent = vlm[3].prompts.process([Image.new("RGB", (56, 56), (30, 200, 40))], "green")
    assert endpoint.lanes["k"].trajectory.vision.pixel_values.equal(sent.pixel_values)


def test_a_text_model_refuses_images_by_name(tiny_qwen2):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    driver = ScriptedDriver(tokenizer, ["never"], tokenizer.eos_token_id)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(data_uri((0, 0, 0)))]}]

    async def main():
        async with serving(tokenizer, driver, params) as (endpoint, port):
            endpoint.open("k")
            with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: this model takes no "
                                                              r"images \(a text model, or a Qwen3.5 checkpoint's "
                                                              r"language model: agent.images=true makes it the "
                                                              r"vision-language model\)") as refused:
                await client(port, "k").chat.completions.create(model="policy", messages=messages)
            return refused.value

    assert asyncio.run(main()).status_code == 400 and driver.calls == []


def test_an_image_part_is_what_the_models_processor_makes_of_it(tiny_vlm):
    """An image part becomes what the model's chat template writes for it (`chat_mark`), expanded as the model's
    transformers processor expands it (the same ids, the same pixels): Gemma 3's blank lines around
    `<start_of_image>`, its soft tokens and `<end_of_image>`; SmolVLM's `<image>` as its tiles and its whole image
    (Idefics3's processor: SmolVLM's own needs torchvision for its video processor, absent here; its image text is
    Idefics3's, `tests/data/test_vision_prompts.py`). Qwen's processors need torchvision too; their image text is the
    dataset path's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    images = RequestImages(VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer))
    prompts, family = images.prompts, images.prompts.family
    if "gemma3" in str(tiny_vlm):
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

        start, pad, end = tokenizer.convert_ids_to_tokens(list(family.marks()))
        marked = AutoTokenizer.from_pretrained(tiny_vlm, extra_special_tokens={
            "boi_token": start, "image_token": pad, "eoi_token": end})
        processor = Gemma3Processor(prompts.image_processor, marked, image_seq_length=family.config.mm_tokens_per_image)
        assert images.mark == "<start_of_image>"
    elif "smolvlm" in str(tiny_vlm):
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        processor = Idefics3Processor(prompts.image_processor, AutoTokenizer.from_pretrained(tiny_vlm),
                                      image_seq_len=family.tokens_per_tile)
        assert images.mark == "<image>"
    else:
        assert images.mark == "<|vision_start|><|image_pad|><|vision_end|>"
        pytest.skip("Qwen2.5-VL's and Qwen3-VL's processors need torchvision (their video processor)")
    text = f"Look:\n{images.mark} and{images.mark}what?"
    pictures = [Image.new("RGB", (60, 90), (220, 30, 30)), Image.new("RGB", (56, 112), (30, 40, 230))]
    theirs = processor(text=[text], images=[pictures], return_tensors="pt")
    vision = images.load([ImagePart(f"messages[0].content[{i}]", data_uri(p.getpixel((0, 0)), p.size))
                          for i, p in enumerate(pictures)])
    ours = tokenizer(images.expand(text, vision), add_special_tokens=False)["input_ids"]
    assert ours == theirs["input_ids"][0].tolist()
    assert prompts.family.pixel_kwargs(vision)["pixel_values"].equal(theirs["pixel_values"])


@pytest.mark.parametrize("tiny_vlm", ["smolvlm"], indirect=True)
def test_a_published_template_renders_the_requests_text_and_images_as_parts(tiny_vlm, caplog):
    """SmolVLM's chat template as published reads contents only as parts: a request's image mark and text reach it as
    image and text parts (the prompt is the parts-form chat's rendering, expanded: `User:` before an image, not
    `User: `), and so do a continuation's, whose contents are appended as plain text (no warning)."""
    from parts_templates import SMOLVLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    tokenizer.chat_template = SMOLVLM
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [tokenizer.eos_token_id], 8, 512)
    images = RequestImages(VisionPrompts.from_pretrained(str(tiny_vlm), tokenizer))
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    red = data_uri((220, 30, 30))
    first = [{"role": "user", "content": [image_part(red), {"type": "text", "text": "Which color?"}]}]

    async def talk(api, endpoint):
        one = await api.chat.completions.create(model="policy", messages=first)
        second = [image_part(data_uri((30, 40, 230), (56, 112))), {"type": "text", "text": "And this?"}]
        follow = [*first, one.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": second}]
        return await api.chat.completions.create(model="policy", messages=follow)

    with caplog.at_level("WARNING", logger="hybridflow.agents.loop.rendering"):
        _, endpoint = run((tiny_vlm, tokenizer, engine, images), params, talk)
    trajectory = endpoint.lanes["k"].trajectory
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which color?"}]}]
    text = tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>User:<image>Which color?<end_of_utterance>\nAssistant:"
    first_image = images.load([ImagePart("first", red)])
    assert trajectory.prompt_ids == tokenizer(images.expand(text, first_image), add_special_tokens=False)["input_ids"]
    context = tokenizer.decode([t for t, m in zip(trajectory.token_ids, trajectory.response_mask) if m == 0])
    assert context.startswith("<end_of_utterance>\nUser:<fake_token_around_image>") and "And this?" in context
    assert trajectory.turns == 1 and len(images.counts(trajectory.vision)) == 2
    assert "changes message contents" not in caplog.text
