"""VisionRolloutEngine on a tiny random Qwen2.5-VL and Qwen3-VL: greedy output equals `transformers.generate` on the same prompt
and image; the vision tower encodes each prompt's images once for all its samples; sampled log-probs are the
engine's; bad vision inputs are refused naming the prompt."""

from __future__ import annotations

import pytest
import torch
from vision_helpers import encoded_prompts

from hybridflow.engine.rollout import SamplingParams
from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine


@pytest.fixture(scope="module")
def setup(tiny_vlm):
    _, rows = encoded_prompts(tiny_vlm)
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [3], 64, 512)
    return engine, rows


def test_greedy_equals_transformers_generate(setup, tiny_vlm):
    from transformers import AutoModelForImageTextToText

    engine, rows = setup
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=0.0, max_tokens=16, n=2),
                           vision=[v for _, v in rows])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    image_id = model.config.image_token_id
    for (ids, vision), samples in zip(rows, outs):
        prompt = torch.tensor([ids])
        expected = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                  mm_token_type_ids=(prompt == image_id).int(), max_new_tokens=16, do_sample=False,
                                  eos_token_id=[3], suppress_tokens=[image_id, model.config.video_token_id],
                                  **(vision.model_kwargs() if vision is not None else {}))
        want = expected[0, len(ids):].tolist()
        assert len(set(want)) > 3  # the random model is not stuck on one token: the comparison means something
        assert [s.token_ids for s in samples] == [want, want]


def test_vision_tower_once_per_prompt_and_logprobs(setup):
    engine, rows = setup
    before = engine.encoded_images
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=3),
                           vision=[v for _, v in rows])
    assert engine.encoded_images - before == 3  # three images over the prompts, however many samples
    assert [len(samples) for samples in outs] == [4, 4, 4]
    for samples in outs:
        assert len({tuple(s.token_ids) for s in samples}) > 1  # the samples diverge after the shared prefill
        for s in samples:
            assert len(s.logprobs) == len(s.token_ids) and all(lp <= 0 for lp in s.logprobs)
    again = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=3),
                            vision=[v for _, v in rows])
    assert [[s.token_ids for s in row] for row in again] == [[s.token_ids for s in row] for row in outs]


def test_vision_placeholders_are_never_drawn_and_log_probs_stay_the_policys(setup):
    """With the image placeholder's logit made to dominate, no sample draws it (in a response the trainer's forward
    would take it for an image position), and each drawn token's log-prob is the policy's over every token: about
    -1e4 here, not the renormalized log-prob of the draw."""
    engine, rows = setup
    boost = torch.tensor([engine.image_token_id])
    hook = engine.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: out.index_fill(-1, boost, 1e4))
    try:
        for params in (SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=0),
                       SamplingParams(temperature=0.0, max_tokens=6)):
            outs = engine.generate([ids for ids, _ in rows], params, vision=[v for _, v in rows])
            samples = [s for row in outs for s in row]
            assert all(engine.image_token_id not in s.token_ids for s in samples)
            assert all(lp < -1e3 for s in samples for lp in s.logprobs)
    finally:
        hook.remove()


def test_bad_vision_inputs_refused(setup):
    engine, rows = setup
    (ids, vision), (_, two) = rows[0], rows[1]
    with pytest.raises(ValueError, match="prompt 0 has .* image tokens .* its images make"):
        engine.generate([ids], SamplingParams(max_tokens=2), vision=[two])
    with pytest.raises(ValueError, match="prompt 0 has .* image tokens"):
        engine.generate([ids], SamplingParams(max_tokens=2))  # images left out
    with pytest.raises(ValueError, match="2 vision inputs for 1 prompts"):
        engine.generate([ids], SamplingParams(max_tokens=2), vision=[vision, vision])
