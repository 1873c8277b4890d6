"""VisionRolloutEngine on a tiny random Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5 and SmolVLM: greedy output equals
`transformers.generate` on the same prompt and image, prompts of different lengths prefilled together (left-padded;
Qwen3.5's linear-attention states handed off beside the K/V) and joining the fast engine's decode as slots free; the
vision tower encodes each prompt's images once for all its samples; one copy of the language model's weights serves the
prefill and the decode, updates included; sampled log-probs are the engine's; placeholders are never drawn; bad vision
inputs are refused naming the prompt."""

from __future__ import annotations

import pytest
import torch
from vision_helpers import encoded_prompts

from hybridflow.data.vision_family import vision_family
from hybridflow.engine.rollout import SamplingParams
from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine


@pytest.fixture(scope="module")
def setup(tiny_vlm):
    _, rows = encoded_prompts(tiny_vlm)
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [3], 64, 512)
    return engine, rows


def generated(model, ids, vision, max_new_tokens):
    """transformers.generate's greedy tokens for one prompt and its images (the placeholders suppressed, as ours)."""
    family = vision_family(model.config)
    prompt = torch.tensor([ids])
    expected = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=[3], suppress_tokens=family.placeholders,
                              **family.model_inputs(prompt, vision))
    return expected[0, len(ids):].tolist()


def test_greedy_equals_transformers_generate(setup, tiny_vlm):
    from transformers import AutoModelForImageTextToText

    engine, rows = setup
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=0.0, max_tokens=16, n=2),
                           vision=[v for _, v in rows])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    for (ids, vision), samples in zip(rows, outs):
        want = generated(model, ids, vision, 16)
        assert len(set(want)) > 3  # the random model is not stuck on one token: the comparison means something
        assert [s.token_ids for s in samples] == [want, want]


@pytest.mark.parametrize("tiny_vlm", ["idefics3"], indirect=True)
def test_idefics3_is_served_by_smolvlms_layout(setup, tiny_vlm):
    """Idefics3 (`Idefics3ForConditionalGeneration`, SmolVLM's parent: one image layout, `SmolVLMFamily`, and Llama's
    decode) generates as `generate` does too; the other tests here run on SmolVLM."""
    test_greedy_equals_transformers_generate(setup, tiny_vlm)


def test_prompts_join_as_slots_free_and_still_equal_generate(tiny_vlm):
    """Four slots for 4 prompts x 2 samples: prompts are prefilled (through the transformers modules) while earlier
    rows decode on the fast engine, into slots finished rows gave back, beside rows of other rope deltas; each row
    still equals `generate`. The context limit gives the longer prompts fewer tokens, so rows finish at different
    steps."""
    from transformers import AutoModelForImageTextToText

    _, rows = encoded_prompts(tiny_vlm)
    rows = rows + [(rows[0][0][:-3], rows[0][1])]  # a shorter prompt with the same image: another length and delta
    context = max(len(ids) for ids, _ in rows) + 5
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [3], 4, context)
    prefills, running = [], []
    forward, start = engine.model.forward, engine._start
    engine.model.forward = lambda *a, **k: prefills.append(k["input_ids"].shape[0]) or forward(*a, **k)
    engine._start = lambda *a: running.append(len(engine.fast.batch)) or start(*a)
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=0.0, max_tokens=12, n=2),
                           vision=[v for _, v in rows])
    assert sum(prefills) == len(rows) and max(running) > 0  # each prompt prefilled once, some beside running rows
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    for (ids, vision), samples in zip(rows, outs):
        want = generated(model, ids, vision, min(12, context - len(ids)))
        assert [s.token_ids for s in samples] == [want, want]


def test_one_copy_of_the_language_model_and_weight_updates_reach_the_decode(tiny_vlm):
    """The fast engine holds the transformers model's tensors (q/k/v as views of its fused projection): a weight
    update copied into the engine is what both the prefill and the decode run, and greedy output equals `generate`
    of the updated model; sleep with offload and wake keep one copy."""
    engine = VisionRolloutEngine(tiny_vlm, torch.device("cpu"), torch.float32, [3], 8, 512)
    kept = "text_model" if "smolvlm" in str(tiny_vlm) else "language_model"  # where the language model is kept
    language = engine.model.model.get_submodule(kept)
    full = next(i for i, layer in enumerate(language.layers) if hasattr(layer, "self_attn"))  # Qwen3.5's 4th
    fused = engine.fast.model.model.layers[full].self_attn.qkv_proj.weight
    q_proj = language.layers[full].self_attn.q_proj.weight
    assert q_proj.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert engine.fast.model.model.embed_tokens.weight.data_ptr() == language.embed_tokens.weight.data_ptr()
    update = {name: p.detach() * 1.5 for name, p in engine.model.named_parameters()
              if name.startswith(f"model.{kept}.layers.") and "proj" in name}
    engine.load_weights(update.items())
    assert torch.equal(fused[:q_proj.shape[0]], update[f"model.{kept}.layers.{full}.self_attn.q_proj.weight"])
    engine.sleep(offload_weights=True)
    engine.wake()
    assert q_proj.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    _, rows = encoded_prompts(tiny_vlm)
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=0.0, max_tokens=10),
                           vision=[v for _, v in rows])
    for (ids, vision), samples in zip(rows, outs):
        assert samples[0].token_ids == generated(engine.model, ids, vision, 10)


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
    # the first token comes from the transformers model's prefill, the others from the fast engine's decode
    hooks = [head.register_forward_hook(lambda module, args, out: out.index_fill(-1, boost, 1e4))
             for head in (engine.model.get_output_embeddings(), engine.fast.model.lm_head)]
    try:
        for params in (SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=0),
                       SamplingParams(temperature=0.0, max_tokens=6)):
            outs = engine.generate([ids for ids, _ in rows], params, vision=[v for _, v in rows])
            samples = [s for row in outs for s in row]
            assert all(engine.image_token_id not in s.token_ids for s in samples)
            assert all(lp < -1e3 for s in samples for lp in s.logprobs)
    finally:
        for hook in hooks:
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


def test_the_device_plans_kv_cache_and_prefill_size_the_vision_engine(tiny_vlm):
    """The device plan's KV cache bytes and prefill forward (what `build_rollout` gets from it) size the vision
    engine as they size the text engine: 5 slots' bytes hold 4 slots and the scratch one, under the plan's figure,
    where taking a share of free memory would give every one of `max_num_seqs`."""
    from hybridflow.config.schema import RolloutConfig
    from hybridflow.workers.rollout_replica import build_rollout

    context = 256
    # images: the run's prompts carry them (a Qwen3.5 checkpoint takes the vision engine then alone)
    probe = build_rollout(str(tiny_vlm), RolloutConfig(max_num_seqs=2), torch.device("cpu"), torch.float32, context,
                          images=True)
    slot = probe.fast.kv.bytes // (probe.fast.kv.num_slots + 1)
    engine = build_rollout(str(tiny_vlm), RolloutConfig(max_num_seqs=64), torch.device("cpu"), torch.float32, context,
                           kv_cache_bytes=5 * slot, max_prefill_tokens=2048, images=True)
    assert engine.fast.kv.num_slots == engine.max_num_seqs == 4 and engine.fast.kv.bytes == 5 * slot
    assert engine.max_prefill_tokens == engine.fast.max_prefill_tokens == 2048
    _, rows = encoded_prompts(tiny_vlm)
    outs = engine.generate([ids for ids, _ in rows], SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=0),
                           vision=[v for _, v in rows])
    assert [len(samples) for samples in outs] == [2, 2, 2]  # 6 rows through 4 slots: the rest wait


@pytest.mark.parametrize("key,why", [("attn_logit_softcapping", "is set"),
                                     ("final_logit_softcapping", "is set in the text config, which "
                                                                 "Gemma3ForConditionalGeneration's forward")])
def test_a_language_model_the_fast_decode_does_not_serve_is_refused_by_name(key, why, tiny_vlm, tmp_path):
    """Gemma 3's text model with attention-logit soft-capping (Gemma 2's; the released Gemma 3 configs leave it unset):
    the fast decode does not apply it, and the vision engine has no transformers.generate path, so it is refused;
    final-logit soft-capping, which the fast decode would apply and transformers' multimodal forward does not."""
    if "gemma3" not in str(tiny_vlm):
        pytest.skip("Qwen's language models have no such options")
    import json
    import shutil

    capped = tmp_path / "capped"
    shutil.copytree(tiny_vlm, capped)
    config = json.loads((capped / "config.json").read_text())
    config["text_config"][key] = 50.0
    (capped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"language model \(gemma3_text\) is not served by the fast decode: "
                                         rf"{key}=50.0 {why}"):
        VisionRolloutEngine(capped, torch.device("cpu"), torch.float32, [3], 4, 256)
