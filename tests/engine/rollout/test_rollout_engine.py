"""The fast rollout engine on CPU (fp32, tiny random Qwen2 / Llama / Qwen3 / Mistral / OLMo 2 / Phi-3 / Gemma 3 /
Qwen3.5 / Qwen3-Next):
parity with HF, the sampling contract, continuous batching, n > 1, stop ids, weight sync, sleep / wake and input
errors."""

from __future__ import annotations

import re

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from tests.engine.rollout.conftest import with_config

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20] * 17, [40, 41], [7] * 30, [100, 200, 3, 4, 5, 6, 7],
           [9], [33, 34, 35, 36] * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def full_logits(model, prompt, tokens):
    """Logits [len(tokens), V] that predicted each generated token, from one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()


@pytest.fixture(scope="module")
def llama3_rope(spread_model, tmp_path_factory):
    """The spread Llama with llama3 rope scaling and a non-default rope_theta."""
    return with_config(spread_model("llama"), tmp_path_factory.mktemp("llama3_rope"),
                       rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})


@pytest.fixture(scope="module")
def phi3_longrope(spread_model, tmp_path_factory):
    """The spread Phi-3 rotating half of each head (Phi-4-mini rotates 0.75) with longrope scaling (the 128k
    variants'), whose short factors hold within original_max_position_embeddings=128."""
    return with_config(spread_model("phi3"), tmp_path_factory.mktemp("phi3_longrope"), partial_rotary_factor=0.5,
                       original_max_position_embeddings=128,  # Phi3Config takes it over rope_parameters' own
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [2.0, 3.0, 5.0, 9.0],
                                        "original_max_position_embeddings": 128})


@pytest.fixture(scope="module")
def gemma3_softcap(spread_model, tmp_path_factory):
    """The spread Gemma 3 (sliding-window layers of 8 tokens, shorter than the generations, and global layers,
    rotated by the local and the linearly scaled global bases) with its final logits soft-capped (Gemma 2 capped at
    30; Gemma 3's checkpoints leave it unset). Greedy tokens are the same under the cap; their log-probs are not."""
    return with_config(spread_model("gemma3_text"), tmp_path_factory.mktemp("gemma3_softcap"),
                       final_logit_softcapping=3.0)


# qwen3_5: a published Qwen3.5 checkpoint (vision tower beside the language model), served from its language model
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral", "olmo2", "phi3", "gemma3_text", "qwen3_5_text",
                                  "qwen3_5", "qwen3_next", "llama3-rope", "phi3-longrope", "gemma3-softcap"])
def test_greedy_matches_transformers_generate(spread_model, llama3_rope, phi3_longrope, gemma3_softcap, arch):
    path = {"llama3-rope": llama3_rope, "phi3-longrope": phi3_longrope,
            "gemma3-softcap": gemma3_softcap}.get(arch) or spread_model(arch)
    # fewer slots than prompts; longrope's short factors hold within its original 128 positions
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=3, max_model_len=128 if arch == "phi3-longrope" else None)
    assert isinstance(engine, RolloutEngine)  # the fast path: the fallback would pass the comparison too
    outs = engine.generate(PROMPTS, GREEDY)
    model = hf_model(path)
    for prompt, (out,) in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"
        # greedy log-probs are log_softmax(logits) of the chosen token
        expected = full_logits(model, prompt, out.token_ids).log_softmax(-1)
        picked = expected.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), picked, atol=1e-4, rtol=0)


def test_phi3_contexts_the_fast_path_cannot_serve_are_refused_by_their_config_value(phi3_longrope, tmp_path, caplog):
    """engine='fast' refuses them, naming the value; 'auto' serves them through transformers.generate, saying why."""
    windowed = with_config(phi3_longrope, tmp_path, sliding_window=64)  # Phi-3-mini-4k's is 2047
    cases = [(phi3_longrope, 129, "'longrope'.*original_max_position_embeddings=128.*max_model_len <= 128"),
             (windowed, 100, "max_model_len=100 exceeds the model's sliding_window=64")]
    for path, length, why in cases:
        with pytest.raises(ValueError, match=why):
            RolloutEngine.from_pretrained(path, max_num_seqs=2, max_model_len=length, engine="fast")
        with caplog.at_level("WARNING"):
            assert RolloutEngine.from_pretrained(path, max_num_seqs=2, max_model_len=length).kind == "hf"
        assert re.search(why, caplog.text)
        caplog.clear()
    assert RolloutEngine.from_pretrained(windowed, max_num_seqs=2, max_model_len=64).kind == "fast"


def test_gemma3_settings_the_fast_path_does_not_serve_are_refused_by_name(spread_model, tmp_path, caplog):
    """Attention soft-capping and bidirectional attention: engine='fast' refuses them, naming the key and its value;
    'auto' serves them through transformers.generate, saying why."""
    for key, value in (("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)):
        (tmp_path / key).mkdir()
        path = with_config(spread_model("gemma3_text"), tmp_path / key, **{key: value})
        why = f"{key}={value} is set, which the fast path does not implement"
        with pytest.raises(ValueError, match=why):
            RolloutEngine.from_pretrained(path, max_num_seqs=2, engine="fast")
        with caplog.at_level("WARNING"):
            assert RolloutEngine.from_pretrained(path, max_num_seqs=2).kind == "hf"
        assert why in caplog.text
        caplog.clear()


def test_gemma3_windows_in_prefill_one_prompt_at_a_time_equal_the_padded_prefill(spread_model, monkeypatch):
    """Prefills past `_PADDED_LIMIT` (prompts x longest^2) run SDPA per prompt: each with its own windowed mask."""
    from hybridflow.engine.rollout import attention

    path = spread_model("gemma3_text")
    want = RolloutEngine.from_pretrained(path, max_num_seqs=8).generate(PROMPTS, GREEDY)
    monkeypatch.setattr(attention, "_PADDED_LIMIT", 0)
    got = RolloutEngine.from_pretrained(path, max_num_seqs=8).generate(PROMPTS, GREEDY)
    for (a,), (b,) in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "olmo2", "phi3", "gemma3_text", "qwen3_5_text", "qwen3_next"])
def test_logprobs_equal_full_forward_at_temperature(spread_model, arch):
    path = spread_model(arch)
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8)
    params = SamplingParams(n=3, temperature=0.7, max_tokens=16, stop_token_ids=[], seed=1)
    outs = engine.generate(PROMPTS[:4], params)
    model = hf_model(path)
    for prompt, samples in zip(PROMPTS[:4], outs):
        assert len(samples) == 3
        for out in samples:
            expected = (full_logits(model, prompt, out.token_ids) / 0.7).log_softmax(-1)
            picked = expected.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out.logprobs), picked, atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (-1, 0.3)])
def test_truncation_never_emits_an_excluded_token(spread_model, top_k, top_p):
    path = spread_model("llama")
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8)
    params = SamplingParams(n=4, temperature=2.0, top_k=top_k, top_p=top_p, max_tokens=12,
                            stop_token_ids=[], seed=3)
    model = hf_model(path)
    for prompt, samples in zip(PROMPTS[:3], engine.generate(PROMPTS[:3], params)):
        for out in samples:
            scaled = full_logits(model, prompt, out.token_ids) / 2.0
            probs = scaled.softmax(-1)
            for step, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
                order = probs[step].argsort(descending=True)
                if top_k > 0:
                    allowed = order[:top_k]
                else:
                    before = probs[step][order].cumsum(0) - probs[step][order]
                    allowed = order[before < top_p]
                assert token in allowed.tolist()
                # log-prob under the truncated, renormalised distribution
                renorm = scaled[step][allowed].log_softmax(-1)[allowed.tolist().index(token)]
                assert abs(logprob - renorm.item()) < 1e-4


def test_seeded_sampling_is_reproducible(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=8)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, stop_token_ids=[], seed=7)
    def tokens(outs):
        return [[s.token_ids for s in row] for row in outs]

    first, again = engine.generate(PROMPTS[:4], params), engine.generate(PROMPTS[:4], params)
    assert tokens(first) == tokens(again)
    other = engine.generate(PROMPTS[:4], SamplingParams(n=2, max_tokens=16, stop_token_ids=[], seed=8))
    assert tokens(other) != tokens(first)
    assert first[0][0].token_ids != first[0][1].token_ids  # the n samples are distinct draws


def test_continuous_batching_matches_one_prompt_at_a_time(spread_model):
    path = spread_model("qwen3")
    prompts = [[(7 * i + j) % 250 + 4 for j in range(1 + (5 * i) % 23)] for i in range(14)]
    batched = RolloutEngine.from_pretrained(path, max_num_seqs=4, max_prefill_tokens=40)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[])
    together = batched.generate(prompts, params)
    assert batched.stats["prefill_forwards"] > 3  # slots were refilled while others decoded
    single = RolloutEngine.from_pretrained(path, max_num_seqs=1)
    for prompt, (out,) in zip(prompts, together):
        assert out.token_ids == single.generate([prompt], params)[0][0].token_ids


def test_n_samples_share_one_prefill(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=16)
    outs = engine.generate(PROMPTS[:4], SamplingParams(n=4, temperature=0.0, max_tokens=10,
                                                       stop_token_ids=[]))
    assert engine.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS[:4])  # not 4x
    single = engine.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[]))
    for samples, (ref,) in zip(outs, single):
        assert [s.token_ids for s in samples] == [ref.token_ids] * 4  # the copied KV is right


def test_stop_ids_are_honoured_and_included(spread_model):
    path = spread_model("qwen2")
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8)
    free = engine.generate(PROMPTS[:4], GREEDY)
    stops = [free[0][0].token_ids[5], free[1][0].token_ids[3]]
    outs = engine.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stops))
    for (ref,), (out,) in zip(free, outs):
        cut = next((k + 1 for k, t in enumerate(ref.token_ids) if t in stops), None)
        assert out.token_ids == ref.token_ids[:cut]
        assert out.finish_reason == ("stop" if cut else "length")
    assert outs[0][0].token_ids[-1] in stops and outs[1][0].token_ids[-1] in stops
    assert engine.default_stop_ids == [3]  # None takes the generation config's eos id


def test_length_is_capped_by_the_context(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=32)
    (out,), = engine.generate([[5] * 28], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[]))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "olmo2", "phi3", "gemma3_text", "qwen3_5_text", "qwen3_next"])
def test_load_weights_gives_the_same_outputs_as_a_fresh_engine(spread_model, arch):
    from safetensors.torch import load_file

    old_path, new_path = spread_model(arch, seed=0), spread_model(arch, seed=1)
    engine = RolloutEngine.from_pretrained(old_path, max_num_seqs=8)
    before = engine.generate(PROMPTS, GREEDY)
    state = load_file(str(new_path / "model.safetensors"))
    # trainer-style names (no `model.` prefix on some), another dtype, and lm_head even though tied
    named = [(k.removeprefix("model.") if i % 2 else k, v.double()) for i, (k, v) in enumerate(state.items())]
    named.append(("lm_head.weight", state.get("lm_head.weight", state["model.embed_tokens.weight"])))
    assert engine.load_weights(named) == len(named)
    after = engine.generate(PROMPTS, GREEDY)
    fresh = RolloutEngine.from_pretrained(new_path, max_num_seqs=8).generate(PROMPTS, GREEDY)
    assert [o[0].token_ids for o in after] == [o[0].token_ids for o in fresh]
    assert [o[0].token_ids for o in after] != [o[0].token_ids for o in before]
    with pytest.raises(KeyError, match="model.layers.0.self_attn.qq_proj.weight"):
        engine.load_weights([("model.layers.0.self_attn.qq_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="does not match"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize("offload", [False, True])
def test_sleep_wake_round_trip(spread_model, offload):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4)
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep(offload_weights=offload)
    assert engine.kv.k is None
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake()
    after = engine.generate(PROMPTS, GREEDY)
    assert [o[0].token_ids for o in after] == [o[0].token_ids for o in before]


def test_a_sync_into_offloaded_weights_brings_them_back_and_wake_moves_nothing(spread_model):
    from safetensors.torch import load_file

    old_path, new_path = spread_model("llama", seed=0), spread_model("llama", seed=1)
    engine = RolloutEngine.from_pretrained(old_path, max_num_seqs=8)
    engine.sleep(offload_weights=True)
    assert engine.weights_offloaded
    state = load_file(str(new_path / "model.safetensors"))
    assert engine.load_weights(state.items()) == len(state)
    assert not engine.weights_offloaded and engine.kv.k is None  # the weights are back, the cache still asleep
    moved = []
    engine._move_weights = moved.append
    engine.wake()
    assert moved == []
    fresh = RolloutEngine.from_pretrained(new_path, max_num_seqs=8).generate(PROMPTS, GREEDY)
    assert [o[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o[0].token_ids for o in fresh]


def test_bad_prompts_get_clear_errors(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1 has 64 tokens.*max_model_len=64"):
        engine.generate([[5, 6], [7] * 64], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 999 outside the vocabulary"):
        engine.generate([[999]], GREEDY)
    with pytest.raises(ValueError, match="n=5 exceeds the engine's 4 KV slots"):
        engine.generate([[5]], SamplingParams(n=5))


def test_a_published_qwen3_5_checkpoint_serves_its_language_model_on_the_fast_path(tiny_model_factory):
    """A `qwen3_5` checkpoint as published (the text model's config under `text_config`, its weights under
    `model.language_model.`, a vision tower beside them): the fast engine reads the language model alone, and the
    log-probs of its samples equal the vision-language model's own forward on the text."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    path = tiny_model_factory("qwen3_5")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(name.startswith("model.visual.") for name in f.keys())
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=4, max_model_len=96)
    assert engine.kind == "fast"
    outs = engine.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_tokens=12, seed=0, stop_token_ids=[]))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, (out,) in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        want = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
