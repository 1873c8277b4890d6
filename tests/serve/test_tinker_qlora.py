"""`hybridflow serve --quantization nf4` through the real SDK: LoRA clients train over one 4-bit copy of the base's
projections that they share, the sampler gets the dequantized base plus their adapters (so its log-probs are the
trainer's), a merged export is a plain model computing them too, and a full-parameter client is refused naming the
flag."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("torchao")

from hybridflow.engine.train.quantized_base import is_nf4  # noqa: E402
from tests.serve.conftest import TOKENS, datum, logprobs, sft_steps, start_server  # noqa: E402


@pytest.fixture(scope="module")
def nf4_server(tiny_qwen2, tmp_path_factory):
    served, stop = start_server(tiny_qwen2, tmp_path_factory.mktemp("nf4"), quantization="nf4", merged_exports=True)
    yield served
    stop()


def test_lora_clients_share_one_4bit_base_and_learn(nf4_server, tmp_path):
    from transformers import AutoModelForCausalLM

    first = nf4_server.client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    second = nf4_server.client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    losses = sft_steps(first, TOKENS, 10, lr=5e-3)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
    base = nf4_server.service.bases.base("tiny")
    quantized = [p for p in base.parameters() if is_nf4(p.data)]
    assert quantized and all(not is_nf4(p.data) for n, p in base.named_parameters() if "embed" in n or "norm" in n)
    models = [nf4_server.service.models[t.model_id].trainee.model for t in (first, second)]
    shared = [{id(p) for p in m.parameters() if is_nf4(p.data)} for m in models]
    assert shared[0] == shared[1] == {id(p) for p in quantized}  # one copy of the 4-bit weights
    sampler = first.save_weights_and_get_sampling_client("after").result()
    prompt = tinker.types.ModelInput.from_ints(TOKENS[:4])
    sample = sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=6, temperature=1.0)).result()
    tokens = TOKENS[:4] + list(sample.sequences[0].tokens)
    trained = logprobs(first, tokens)[3:]
    torch.testing.assert_close(torch.tensor(sample.sequences[0].logprobs), trained, atol=2e-3, rtol=0)
    first.save_weights_external("merged").result()
    merged = AutoModelForCausalLM.from_pretrained(nf4_server.checkpoint_dir / first.model_id / "external_weights" /
                                                  "merged")
    assert not any(is_nf4(p.data) for p in merged.parameters())
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([tokens[:-1]])).logits.float()
    exported = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(exported, logprobs(first, tokens), atol=1e-4, rtol=0)
    assert second.forward([datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()


def test_a_full_parameter_client_is_refused_naming_the_flag(nf4_server):
    with pytest.raises(tinker.RequestFailedError, match="--quantization nf4"):
        nf4_server.client.create_lora_training_client(base_model="tiny", rank=0).result()


def test_the_serve_command_passes_the_quantization(tiny_qwen2, monkeypatch):
    from hybridflow.cli import main
    from hybridflow.serve import http_api

    started = []
    monkeypatch.setattr(http_api, "serve", lambda config, *args: started.append(config))
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--quantization", "nf4", "--device", "cpu"]) == 0
    assert started[0].quantization == "nf4"
