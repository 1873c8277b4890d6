"""The service's sampling engine as `hybridflow serve` sizes it: its precision (`--sampler-dtype`), its KV cache's
share of free memory (`--kv-cache-memory`) and slot length (`--max-model-len`), and a request that runs out of device memory answered with the flags
that would make it fit while the server goes on."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.serve.conftest import TOKENS, datum, logprobs, start_server  # noqa: E402


def _greedy(client, prompt: list[int]):
    sampler = client.create_sampling_client(base_model="tiny").result()
    return sampler.sample(types.ModelInput.from_ints(prompt), 1,
                          types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]


def test_a_bf16_sampler_in_a_bounded_cache_samples_near_the_fp32_trainer(tiny_qwen2, tmp_path, monkeypatch):
    """sampler_dtype=bf16 builds the engine in bf16 (the default on CUDA) while the trainer stays fp32: the sampled
    log-probs agree to bf16's precision, not bitwise. kv_cache_memory bounds the cache to that share of free
    memory: 3 slots where 8 were asked; requests for more samples than slots queue in the engine, and one prompt's
    samples past the slots are refused naming the flags."""
    from transformers import AutoConfig

    from hybridflow.engine.rollout import kv_cache
    from hybridflow.serve import tinker_service  # noqa: F401  bound to the real free_memory before the patch below

    # the adapter's initial weights, so the gaps below do not hang on the tests run before this one in the process:
    # after one order of tests the trained snapshot's greedy path met a token where bf16 weights move the log-prob by
    # 0.11 (transformers' own bf16 forward as much as the engine: 0.119 against 0.002 to 0.006 for seeds 0-6)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_qwen2)
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = 2 * config.num_hidden_layers * 64 * config.num_key_value_heads * head_dim * 2  # 64 positions, bf16
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: 16 * per_slot)  # a quarter: 4 slots, one scratch
    served, stop = start_server(tiny_qwen2, tmp_path, sampler_dtype="bf16", kv_cache_memory=0.25,
                                 max_model_len=64)
    try:
        trainer = served.client.create_lora_training_client(base_model="tiny", rank=2).result()
        seq = _greedy(served.client, TOKENS[:5])
        engine = served.service.samplers["tiny"].engine
        assert engine.dtype == torch.bfloat16 and engine.kv.k.dtype == torch.bfloat16
        assert next(iter(served.service.bases.base("tiny").parameters())).dtype == torch.float32
        assert engine.max_model_len == 64 and engine.kv.num_slots == 3 and engine.kv.bytes <= 0.25 * 16 * per_slot
        trained = logprobs(trainer, TOKENS[:5] + list(seq.tokens))[4:]
        gap = (torch.tensor(seq.logprobs) - trained).abs().max().item()
        assert 0 < gap < 0.1, gap  # bf16 weights and cache: close to the fp32 trainer, and not the same numbers
        # a trained client's fp32 snapshot, loaded into the bf16 engine in place
        trainer.forward_backward([datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        snapshot = trainer.save_weights_and_get_sampling_client().result()
        tuned = snapshot.sample(types.ModelInput.from_ints(TOKENS[:5]), 1,
                                types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
        assert engine.dtype == torch.bfloat16 and served.service.samplers["tiny"].engine is engine
        moved = logprobs(trainer, TOKENS[:5] + list(seq.tokens))[4:]
        assert (moved - trained).abs().max().item() > 0.3  # far past bf16's gap: stale base weights would show
        after = logprobs(trainer, TOKENS[:5] + list(tuned.tokens))[4:]
        assert (torch.tensor(tuned.logprobs) - after).abs().max().item() < 0.1
        sampler = served.client.create_sampling_client(base_model="tiny").result()
        asked = [sampler.sample(types.ModelInput.from_ints(TOKENS[:5 + i]), 3, types.SamplingParams(max_tokens=4))
                 for i in range(3)]  # 9 sequences at once through 3 slots
        assert [len(f.result().sequences) for f in asked] == [3, 3, 3]
        with pytest.raises(tinker.RequestFailedError, match="num_samples=4 is more than the sampling engine's 3 "
                                                              "sequences.*--max-num-seqs or --kv-cache-memory"):
            sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), 4, types.SamplingParams(max_tokens=4)).result()
    finally:
        stop()


def test_auto_samples_and_trains_in_fp32_on_cpu_and_bf16_on_cuda(tmp_path):
    from hybridflow.serve.config import ServeConfig

    assert ServeConfig({}, device="cpu").sampler_torch_dtype() == torch.float32
    assert ServeConfig({}, device="cuda").sampler_torch_dtype() == torch.bfloat16
    assert ServeConfig({}, device="cuda", sampler_dtype="fp32").sampler_torch_dtype() == torch.float32
    assert ServeConfig({}, device="cpu").train_torch_dtype() == torch.float32
    assert ServeConfig({}, device="cuda").train_torch_dtype() == torch.bfloat16
    assert ServeConfig({}, device="cuda", train_dtype="fp32").train_torch_dtype() == torch.float32
    for bad, message in (({"sampler_dtype": "fp16"}, "--sampler-dtype fp16: valid: auto, bf16, fp32"),
                         ({"train_dtype": "fp8"}, "--train-dtype fp8: valid: auto, bf16, fp32"),
                         ({"kv_cache_memory": 1.5}, r"--kv-cache-memory=1.5 must be a fraction of free memory in \(0, 1\)"),
                         ({"max_num_seqs": 0}, "--max-num-seqs=0 must be >= 1"),
                         ({"max_model_len": -1}, "--max-model-len=-1 must be >= 0")):
        with pytest.raises(ValueError, match=message):
            ServeConfig({}, **bad)


def test_the_serve_command_passes_its_precision_and_sampler_flags(tiny_qwen2, monkeypatch, capsys):
    from hybridflow.cli import main
    from hybridflow.serve import http_api

    seen = []
    monkeypatch.setattr(http_api, "serve", lambda config, host, port, key: seen.append(config))
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--device", "cpu", "--sampler-dtype", "bf16",
                 "--kv-cache-memory", "0.5", "--max-num-seqs", "16", "--max-model-len", "512",
                 "--train-dtype", "fp32"]) == 0
    assert (seen[0].sampler_dtype, seen[0].kv_cache_memory, seen[0].max_num_seqs, seen[0].max_model_len,
            seen[0].train_dtype) == ("bf16", 0.5, 16, 512, "fp32")
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--kv-cache-memory", "0"]) == 2
    assert "--kv-cache-memory=0.0 must be a fraction" in capsys.readouterr().err


def test_running_out_of_device_memory_names_the_flags_and_the_server_goes_on(tiny_qwen2, tmp_path, monkeypatch):
    from hybridflow.serve import tinker_service

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.47 GiB. GPU 0 has 1.99 GiB free.")

    monkeypatch.setattr(tinker_service, "Sampler", out_of_memory)
    served, stop = start_server(tiny_qwen2, tmp_path)
    try:
        with pytest.raises(tinker.RequestFailedError,
                           match=r"ran out of memory \(CUDA out of memory.*--micro-batch-tokens.*--kv-cache-memory or "
                                 r"--max-num-seqs"):
            _greedy(served.client, TOKENS[:5])
        trainer = served.client.create_lora_training_client(base_model="tiny", rank=2).result()
        out = trainer.forward([datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(TOKENS) - 1  # still serving
    finally:
        stop()


def test_a_prompt_the_fallback_engine_cannot_hold_fails_alone(tiny_qwen2):
    """An architecture without a fast path samples through `transformers.generate`, in one batch: a prompt past its
    context is answered alone, with the flag that lengthens it, and the batch's other prompt is sampled."""
    from hybridflow.engine.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
    from hybridflow.serve.sampler import Sampler

    sampler = Sampler(tiny_qwen2, "cpu", max_num_seqs=4)
    sampler.engine = RolloutEngine.from_pretrained(tiny_qwen2, device="cpu", engine="hf", max_model_len=16)
    assert isinstance(sampler.engine, HFRolloutEngine)
    answers: dict[int, object] = {}
    sampler.stream(None, None, SamplingParams(n=2, max_tokens=3), [(7, [1] * 16), (8, TOKENS[:4])], list,
                   answers.__setitem__)
    assert isinstance(answers[7], ValueError)
    assert "prompt 0 has 16 tokens but the context holds max_model_len=16" in str(answers[7])
    assert "restart hybridflow serve with a larger --max-model-len" in str(answers[7])
    samples, scores = answers[8]
    assert [len(tokens) for tokens, _, _ in samples] == [3, 3] and scores is None  # both samples, 3 tokens each
