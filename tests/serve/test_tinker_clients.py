"""Training clients beyond one LoRA: full-parameter clients (rank 0), resumed exactly from saved state, and
several LoRA clients on one base sharing its weights while training independently; through the real SDK."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.serve.conftest import TOKENS, logprobs, sft_steps  # noqa: E402

OTHER = list(range(70, 90))  # a second sequence, for the second client


def test_a_full_parameter_client_trains_resumes_exactly_and_samples_its_weights(server):
    full = server.client.create_lora_training_client(base_model="tiny", rank=0).result()
    info = full.get_info()
    assert (info.is_lora, info.lora_rank) == (False, None)
    trainee = server.service.models[full.model_id].trainee
    assert all(p.requires_grad for p in trainee.model.parameters())  # every weight trains, not adapters
    losses = sft_steps(full, TOKENS, 3, lr=1e-3)
    assert losses[-1] < losses[0], losses

    path = full.save_state("mid").result().path
    assert server.rest().get_weights_info_by_tinker_path(path).result().is_lora is False
    uninterrupted = sft_steps(full, TOKENS, 2, lr=1e-3)
    resumed = server.client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().is_lora is False
    assert sft_steps(resumed, TOKENS, 2, lr=1e-3) == uninterrupted  # the same losses, bit for bit
    torch.testing.assert_close(logprobs(resumed, TOKENS), logprobs(full, TOKENS), atol=0, rtol=0)

    sampler = full.save_weights_and_get_sampling_client().result()  # every weight loaded into the engine
    prompt = TOKENS[:5]
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    torch.testing.assert_close(torch.tensor(seq.logprobs), logprobs(full, prompt + list(seq.tokens))[len(prompt) - 1:],
                               atol=1e-4, rtol=0)


def test_lora_clients_on_one_base_share_its_weights_and_train_independently(server):
    first = server.client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    second = server.client.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    models = [server.service.models[c.model_id].trainee.model for c in (first, second)]
    base = server.service.bases.base("tiny")
    name = "model.layers.0.self_attn.q_proj"
    frozen = [dict(m.named_modules())[name].base_layer.weight for m in models]
    assert frozen[0] is frozen[1] is dict(base.named_modules())[name].weight  # one tensor, held once

    second_before = logprobs(second, OTHER)
    first_losses = sft_steps(first, TOKENS, 3)
    assert first_losses[-1] < first_losses[0], first_losses
    torch.testing.assert_close(logprobs(second, OTHER), second_before, atol=0, rtol=0)  # untouched by first's steps

    first_before = logprobs(first, TOKENS)
    second_losses = sft_steps(second, OTHER, 3)
    assert second_losses[-1] < second_losses[0], second_losses
    torch.testing.assert_close(logprobs(first, TOKENS), first_before, atol=0, rtol=0)
    assert not any(p.requires_grad for p in base.parameters())  # the base itself never trains


def test_a_checkpoint_of_one_kind_is_refused_by_a_client_of_another(server):
    lora = server.client.create_lora_training_client(base_model="tiny", rank=2).result()
    path = lora.save_state("lora-state").result().path
    full = server.client.create_lora_training_client(base_model="tiny", rank=0).result()
    with pytest.warns(FutureWarning), pytest.raises(tinker.RequestFailedError,
                                                    match="holds rank-2 LoRA weights.*full-parameter"):
        full.load_state(path).result()
    assert len(sft_steps(full, TOKENS[:8], 1)) == 1  # the server goes on
