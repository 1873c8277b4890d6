"""Exact mode: the log-prob the rollout engine reports for every sampled token equals, bit for bit, the training
engine's forward of the same sequence, whatever the batch: prompt lengths and batch sizes, the slots that
continuous batching admits prompts into (and in which order), the trainer's micro-batches, a multi-turn
continuation from the KV cache, and LoRA's merged weights. On the CPU in fp32; on a GPU (marked `gpu`) the
same in fp32 and bf16 with decode in CUDA graphs, and at bf16 on SmolLM2-135M-Instruct for a 64 x 8 batch
of 256-token responses."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.model_schema import LoraConfig, ModelConfig, OptimConfig
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.train import TrainEngine

MAX_LEN = 64
DEVICES = [pytest.param("cpu", "fp32", id="cpu-fp32"),
           pytest.param("cuda", "fp32", id="cuda-fp32", marks=pytest.mark.gpu),
           pytest.param("cuda", "bf16", id="cuda-bf16", marks=pytest.mark.gpu)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _trainer(path, device: str = "cpu", dtype: str = "fp32", lora: LoraConfig | None = None,
             max_len: int = MAX_LEN) -> TrainEngine:
    """A trained policy (fp32 master weights; bf16 compute under autocast) whose forward is exact."""
    model = ModelConfig(path=str(path), dtype=dtype, gradient_checkpointing=False)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, lora=lora or LoraConfig())
    return TrainEngine(model, optim, head="lm", device=torch.device(device), exact_len=max_len)


def _prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (n,), generator=g).tolist() for n in lengths]


def _batch(rows: list[tuple[list[int], list[int], list[float], list[int]]]) -> tuple[dict, torch.Tensor]:
    """RL rows from (prompt, response tokens, their rollout log-probs, response mask) -> (batch, rollout
    log-probs [B, R])."""
    width_p, width_r = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    ids = torch.zeros(len(rows), width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rollout, response_mask = torch.zeros(len(rows), width_r), torch.zeros(len(rows), width_r)
    for i, (prompt, tokens, logprobs, kept) in enumerate(rows):
        ids[i, width_p - len(prompt):width_p] = torch.tensor(prompt)
        ids[i, width_p:width_p + len(tokens)] = torch.tensor(tokens)
        mask[i, width_p - len(prompt):width_p + len(tokens)] = 1
        rollout[i, :len(tokens)] = torch.tensor(logprobs)
        response_mask[i, :len(tokens)] = torch.tensor(kept, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}, rollout


def _gap(trainer: TrainEngine, rows, temperature: float, **batching) -> float:
    """The largest |trainer log-prob - rollout log-prob| over the rows' response tokens."""
    batch, rollout = _batch(rows)
    log_probs = trainer.infer(batch, temperature=temperature, **batching)["log_probs"]
    return float(((log_probs - rollout).abs() * batch["response_mask"]).max())


def _generated_rows(engine, prompts, params):
    outs = engine.generate(prompts, params)
    return [(p, c.token_ids, c.logprobs, [1] * len(c.token_ids)) for p, row in zip(prompts, outs) for c in row]


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_every_sampled_log_prob_is_the_trainers(spread_model, arch, device, dtype):
    path = spread_model(arch)
    trainer = _trainer(path, device, dtype)
    prompts = _prompts((1, 4, 9, 17, 6, 30))
    # few slots queue the prompts (admitted as rows finish, in another order); greedy rows are scored at 1
    for slots, order, params in ((2, slice(None), dict(n=2, temperature=1.0, max_tokens=12, seed=1)),
                                 (16, slice(None, None, -1), dict(n=3, temperature=0.7, max_tokens=9, seed=2)),
                                 (3, slice(None), dict(temperature=0.0, max_tokens=10))):
        engine = RolloutEngine.from_pretrained(path, device=device, dtype=DTYPES[dtype], exact=True,
                                               max_num_seqs=slots, max_model_len=MAX_LEN, max_prefill_tokens=24)
        rows = _generated_rows(engine, prompts[order], SamplingParams(stop_token_ids=[], **params))
        temperature = params["temperature"] or 1.0
        for batching in ({}, {"micro_batch_size": 1}, {"max_tokens": 40}):
            assert _gap(trainer, rows, temperature, **batching) == 0.0, (slots, params, batching)


def test_a_continued_turn_is_the_trainers_forward_of_the_whole_conversation(spread_model):
    """Turns decoded from the KV cache after environment tokens were appended (a held session, as the agent
    loop runs it) score like one forward over prompt, turn, environment reply and next turn."""
    path = spread_model("qwen2")
    engine = RolloutEngine.from_pretrained(path, exact=True, max_num_seqs=4, max_model_len=MAX_LEN)
    prompts, replies = _prompts((5, 11, 3)), _prompts((4, 2, 7), seed=1)
    session = engine.session(SamplingParams(temperature=1.0, max_tokens=6, seed=3, stop_token_ids=[]), hold=True)
    seqs = [session.add(p)[0] for p in prompts]
    first = session.run()
    for seq, reply in zip(seqs, replies):
        session.extend(seq, reply, max_tokens=5)
    second = session.run()
    rows = []
    for seq, prompt, reply in zip(seqs, prompts, replies):
        a, b = first[seq], second[seq]
        tokens = a.token_ids + reply + b.token_ids
        rows.append((prompt, tokens, a.logprobs + [0.0] * len(reply) + b.logprobs,
                     [1] * len(a.token_ids) + [0] * len(reply) + [1] * len(b.token_ids)))
    assert _gap(_trainer(path), rows, 1.0) == 0.0


LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=[], init="default")


def _adapted(trainer: TrainEngine, seed: int = 5) -> TrainEngine:
    """B starts at 0 (the adapted policy is the base model): give the adapters something to add."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in trainer.adapters.layers.values():
            weight = layer.lora_B["default"].weight
            weight.copy_(0.1 * torch.randn(weight.shape, generator=g))
    return trainer


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_lora_merged_weights_sample_what_the_adapted_trainer_scores(spread_model, device, dtype):
    path = spread_model("llama")
    trainer = _adapted(_trainer(path, device, dtype, LORA))
    engine = RolloutEngine.from_pretrained(path, device=device, dtype=DTYPES[dtype], exact=True, max_num_seqs=8,
                                           max_model_len=MAX_LEN)
    engine.load_weights(trainer.rollout_weights(DTYPES[dtype]))
    rows = _generated_rows(engine, _prompts((3, 8, 13)),
                           SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=4, stop_token_ids=[]))
    assert _gap(trainer, rows, 1.0) == 0.0
    with trainer.adapters.disabled():  # the reference policy: the base weights, which the engine no longer has
        assert _gap(trainer, rows, 1.0) > 1e-3


@pytest.mark.gpu
@pytest.mark.real_model
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_smollm2_bf16_64_prompts_x_8_samples_x_256_tokens(smollm2, lora):
    """The issue's GPU check: SmolLM2-135M-Instruct at bf16, 512 sampled responses of 256 tokens (decode in
    CUDA graphs, 512 rows), scored by the trainer's no-grad pass in 16k-token micro-batches and by a training
    forward (autograd on) of 32 rows: not one log-prob differs."""
    from transformers import AutoTokenizer

    from hybridflow.data.chat import encode_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    questions = [f"Tom has {a} marbles and finds {b} more. How many marbles does he have now? Explain."
                 for a, b in zip(range(3, 67), range(70, 6, -1))]
    prompts = encode_prompts([[{"role": "user", "content": q}] for q in questions], tokenizer)
    max_len = max(map(len, prompts)) + 256
    trainer = _trainer(smollm2, "cuda", "bf16", lora, max_len)
    engine = RolloutEngine.from_pretrained(smollm2, device="cuda", dtype=torch.bfloat16, exact=True, max_num_seqs=512,
                                           max_model_len=max_len)
    if lora is not None:
        engine.load_weights(_adapted(trainer, seed=6).rollout_weights(torch.bfloat16))
    rows = _generated_rows(engine, prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256, seed=0,
                                                           stop_token_ids=[]))
    assert len(rows) == 512 and all(len(row[1]) == 256 for row in rows)
    assert _gap(trainer, rows, 1.0, max_tokens=16384) == 0.0
    batch, rollout = _batch(rows[::16])
    with torch.enable_grad():
        log_probs = trainer.forward(batch)[0]["log_probs"].cpu()
    assert float(((log_probs - rollout).abs() * batch["response_mask"]).max()) == 0.0
