"""Prompt log-probs through the real `tinker` SDK: `compute_logprobs` (DPO's reference, on-policy distillation's
teacher, a KL metric against the base), `prompt_logprobs_last_n`, and `sample` with `include_prompt_logprobs` and
`topk_prompt_logprobs`, against the trainer's forward and a transformers forward; concurrent requests share a batch;
the options still not served are refused by name."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.serve.conftest import TOKENS, datum, logprobs  # noqa: E402

PROMPT = TOKENS[:10]


def test_compute_logprobs_equals_the_trainers_forward_on_the_base_and_on_a_trained_snapshot(server):
    client = server.client
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    base = client.create_sampling_client(base_model="tiny").result()
    scores = base.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert scores[0] is None and len(scores) == len(PROMPT)
    torch.testing.assert_close(torch.tensor(scores[1:]), logprobs(trainer, PROMPT), atol=1e-4, rtol=0)
    trainer.forward_backward([datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    tuned = trainer.save_weights_and_get_sampling_client().result()
    after = tuned.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    trained = logprobs(trainer, PROMPT)
    assert (trained - torch.tensor(scores[1:])).abs().max() > 0.1  # the step moved them: a stale base would show
    torch.testing.assert_close(torch.tensor(after[1:]), trained, atol=1e-4, rtol=0)
    last = tuned.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(PROMPT) - 3)
    torch.testing.assert_close(torch.tensor(last[-3:]), trained[-3:], atol=1e-4, rtol=0)


def test_sample_returns_the_prompts_top_k_beside_its_samples(server, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    sampler = server.client.create_sampling_client(base_model="tiny").result()
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4),
                         include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1], -1)
    top = logp.topk(3, -1)
    assert out.prompt_logprobs[0] is None and out.topk_prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]),
                               logp.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1), atol=1e-4, rtol=0)
    for position, found in enumerate(out.topk_prompt_logprobs[1:]):
        assert [t for t, _ in found] == top.indices[position].tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in found]), top.values[position], atol=1e-4, rtol=0)
    only_top = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                              topk_prompt_logprobs=2).result()
    assert only_top.prompt_logprobs is None  # not asked for: the top-k alone
    assert [[t for t, _ in found] for found in only_top.topk_prompt_logprobs[1:]] == top.indices[:, :2].tolist()
    last = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                          include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2).result()
    assert last.prompt_logprobs[:-2] == last.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert [[t for t, _ in found] for found in last.topk_prompt_logprobs[-2:]] == top.indices[-2:, :2].tolist()


def test_concurrent_compute_logprobs_share_a_batch(server):
    client = server.client
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompts = [TOKENS[i:i + 6 + i] for i in range(6)]
    before = len(server.service.queue.batches)
    futures = [sampler.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
    results = [f.result() for f in futures]
    for prompt, got in zip(prompts, results):
        torch.testing.assert_close(torch.tensor(got[1:]), logprobs(trainer, prompt), atol=1e-4, rtol=0)
    sampled = server.service.queue.batches[before:before + len(prompts)]
    assert sum(sampled) >= len(prompts) and max(sampled) > 1  # at least two rode one engine session


@pytest.mark.parametrize("option, value, message", [
    ("topk_sample_logprobs", 2, r"sample options \['topk_sample_logprobs'\] are not served"),
    ("prompt_alt_tokens_k", 2, r"sample options \['prompt_alt_tokens_k'\] are not served"),
])
def test_options_still_not_served_are_refused_by_name(server, option, value, message):
    sampler = server.client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.RequestFailedError, match=message):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2),
                       **{option: value}).result()


def test_a_prompt_logprobs_window_past_the_prompt_is_refused_and_the_server_goes_on(server):
    sampler = server.client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.RequestFailedError, match=r"prompt_logprobs_last_n=10 needs prompt_logprobs, and must "
                                                        r"be between 1 and the prompt's length - 1 \(9\)"):
        sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=10).result()
    with pytest.raises(tinker.RequestFailedError, match="topk_prompt_logprobs=-1 must be >= 0"):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                       include_prompt_logprobs=True, topk_prompt_logprobs=-1).result()
    assert len(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT[:2])).result()) == 2
