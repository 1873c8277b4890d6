"""The fast rollout engine on a real pretrained model (SmolLM2-135M-Instruct, fp32, CPU): greedy output equals
`transformers.generate` token for token, and sampled log-probs equal a full forward at the temperature.
A real model's peaked distributions make near-ties and large log-probs that random weights never show."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data.chat import encode_prompts
from hybridflow.engine.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.real_model

QUESTIONS = ["Ava has 7 apples and buys 5 more. How many apples does she have?",
             "Name three primary colors.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def prompts_and_model(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = encode_prompts([[{"role": "user", "content": q}] for q in QUESTIONS], tokenizer)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    return tokenizer, prompts, model, RolloutEngine.from_pretrained(smollm2, max_num_seqs=8, max_model_len=256)


def _forward_log_probs(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_matches_transformers_generate(prompts_and_model):
    tokenizer, prompts, model, engine = prompts_and_model
    assert engine.kind == "fast"
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for prompt, (out,) in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=2,
                                 pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        torch.testing.assert_close(torch.tensor(out.logprobs), _forward_log_probs(model, prompt, out.token_ids, 1.0),
                                   atol=1e-4, rtol=0)
    assert "12 apples" in tokenizer.decode(outs[0][0].token_ids)  # a pretrained model: it can add 7 and 5
    assert outs[1][0].finish_reason == "stop" and outs[1][0].token_ids[-1] == 2  # ends its turn with <|im_end|>


def test_sampled_log_probs_equal_a_forward_pass(prompts_and_model):
    _, prompts, model, engine = prompts_and_model
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_tokens=24, seed=3))
    for prompt, samples in zip(prompts, outs):
        for out in samples:
            torch.testing.assert_close(torch.tensor(out.logprobs),
                                       _forward_log_probs(model, prompt, out.token_ids, 0.8), atol=1e-4, rtol=0)
