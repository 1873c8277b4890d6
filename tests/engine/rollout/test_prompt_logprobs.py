"""Prompt log-probs (`scoring.prompt_logprobs`, what a Tinker `compute_logprobs` asks for) against a transformers
forward: packed prompts, the head in pieces, forwards split by the token budget, the fallback engine, and a session
in flight left as it was."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams, scoring

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [20] * 17, [100, 200, 3, 4, 5, 6, 7], [33, 34, 35, 36] * 3]


def hf_scores(path, prompt: list[int], k: int):
    """(log-probs [n - 1], top-k log-probs [n - 1, k], their ids) from one transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    top = logp.topk(k, -1)
    return logp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), top.values, top.indices


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text", "qwen3_5_text"])
def test_prompt_log_probs_equal_a_transformers_forward(spread_model, arch, monkeypatch):
    """Gemma 3: soft-capped logits and sliding-window layers; Qwen3.5: linear-attention states, which the scoring
    forward leaves in the scratch slot. The head runs over 3 rows at a time and a forward over at most 20 tokens: the
    same numbers as one piece."""
    path = spread_model(arch)
    engine = RolloutEngine.from_pretrained(path, device="cpu", dtype=torch.float32, max_num_seqs=4, max_model_len=64)
    whole = scoring.prompt_logprobs(engine, PROMPTS, topk=3)
    for prompt, got in zip(PROMPTS, whole):
        logprobs, top_lps, top_ids = hf_scores(path, prompt, 3)
        torch.testing.assert_close(got.logprobs, logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.top_logprobs, top_lps, atol=1e-4, rtol=0)
        assert torch.equal(got.top_ids, top_ids)
        assert (got.logprobs <= got.top_logprobs[:, 0] + 1e-6).all()
    monkeypatch.setattr(scoring, "LOGIT_BYTES", 3 * 4 * engine.config.vocab_size)
    engine.max_prefill_tokens = 20
    for a, b in zip(scoring.prompt_logprobs(engine, PROMPTS, topk=3), whole):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(a.top_ids, b.top_ids)
    plain = scoring.prompt_logprobs(engine, PROMPTS[:1])[0]
    assert plain.top_ids is None and plain.top_logprobs is None
    torch.testing.assert_close(plain.logprobs, whole[0].logprobs, atol=1e-5, rtol=0)


def test_the_fallback_engine_scores_the_same(spread_model):
    path = spread_model("qwen2")
    fast = RolloutEngine.from_pretrained(path, device="cpu", dtype=torch.float32, max_num_seqs=4, max_model_len=64)
    hf = RolloutEngine.from_pretrained(path, device="cpu", dtype=torch.float32, max_num_seqs=4, max_model_len=64,
                                       engine="hf")
    assert not isinstance(hf, RolloutEngine)
    for a, b in zip(scoring.prompt_logprobs(hf, PROMPTS, topk=2), scoring.prompt_logprobs(fast, PROMPTS, topk=2)):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert torch.equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5_text"])
def test_scoring_between_a_sessions_steps_leaves_its_sequences_as_they_were(spread_model, arch):
    """The scoring forward writes only the scratch slot: a greedy session scored between its steps ends with the
    tokens and log-probs of one left alone."""
    engine = RolloutEngine.from_pretrained(spread_model(arch), device="cpu", dtype=torch.float32, max_num_seqs=4,
                                           max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])

    def run(score: bool) -> list[tuple[list[int], list[float]]]:
        session = engine.session(params)
        for prompt in PROMPTS[:3]:
            session.add(prompt)
        done = []
        while session.has_work:
            done += session.step()
            if score:
                scoring.prompt_logprobs(engine, [PROMPTS[4], [7] * 40])
        return [(c.token_ids, c.logprobs) for _, c in sorted(done, key=lambda x: x[0])]

    assert run(True) == run(False)


def test_prompts_that_cannot_be_scored_are_named_and_a_lone_token_scores_nothing(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), device="cpu", dtype=torch.float32, max_num_seqs=2,
                                           max_model_len=32)
    with pytest.raises(ValueError, match="prompt 1 is empty: score prompts of at least one token"):
        scoring.prompt_logprobs(engine, [[1, 2], []])
    one, two = scoring.prompt_logprobs(engine, [[3], [1, 2]], topk=2)  # a lone token has nothing before it
    assert one.logprobs.shape == (0,) and one.top_ids.shape == (0, 2) and two.logprobs.shape == (1,)
    with pytest.raises(ValueError, match="topk=-1 must be >= 0"):
        scoring.prompt_logprobs(engine, [[1, 2]], topk=-1)
    with pytest.raises(ValueError, match="prompt 0 has 33 tokens, more than the engine's context of max_model_len=32"):
        scoring.prompt_logprobs(engine, [[1] * 33])
