"""Pieces of the rollout engine on their own: SamplingParams validation, the sampler, the scheduler, the
CUDA-graph buckets, the decode attention split heuristic, and the `transformers.generate` fallback for an
architecture without a fast path."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
from hybridflow.engine.rollout.cuda_graphs import bucket_sizes
from hybridflow.engine.rollout.sampler import _truncate, sample
from hybridflow.engine.rollout.scheduler import Scheduler
from hybridflow.engine.rollout.sequence import Request


@pytest.mark.parametrize("kwargs,field", [(dict(n=0), "n"), (dict(temperature=-1.0), "temperature"),
                                          (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"),
                                          (dict(max_tokens=0), "max_tokens"),
                                          (dict(stop_token_ids=[-1]), "stop_token_ids"),
                                          (dict(seed="x"), "seed")])
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_sampler_truncation_and_logprobs():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits.clone(), SamplingParams(top_k=2), gen)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor([4.0, 3.0]).log_softmax(-1)
    assert torch.allclose(logprobs, expected[tokens], atol=1e-6)
    # top_p=0.7 keeps {0, 1}: p0 = 0.64 < 0.7, so token 1 is needed; p0 + p1 = 0.88 >= 0.7 drops the rest
    tokens, _ = sample(logits.clone(), SamplingParams(top_p=0.7), gen)
    assert set(tokens.tolist()) == {0, 1}
    # untruncated sampling follows softmax(logits / T)
    tokens, logprobs = sample(logits.clone(), SamplingParams(temperature=2.0), gen)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert torch.allclose(freq, (logits[0] / 2.0).softmax(-1), atol=0.03)
    assert torch.allclose(logprobs, (logits[0] / 2.0).log_softmax(-1)[tokens], atol=1e-6)
    tokens, logprobs = sample(logits.clone(), SamplingParams(temperature=0.0), None)
    assert (tokens == 0).all() and torch.allclose(logprobs, logits[0].log_softmax(-1)[0].expand(4000))


def policy_log_probs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-probs of `tokens` under the unmasked logits: at the sampling temperature within top-k / top-p, at
    temperature 1 when greedy (what the trainer computes for them)."""
    x = logits.float().clone()
    if not params.greedy:
        x = _truncate(x.div_(params.temperature), params.top_k, params.top_p)
    return x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=3), SamplingParams(top_p=0.9)])
def test_ids_never_drawn_keep_the_policys_log_probs(params):
    """`never` (a vision model's placeholders): the ids are never drawn, even when most likely, and each drawn token's
    log-prob is `policy_log_probs` of the unmasked logits, what the trainer computes for it; the rest follow softmax."""
    logits = torch.tensor([[6.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    tokens, logprobs = sample(logits.clone(), params, torch.Generator().manual_seed(0), never=torch.tensor([0, 2]))
    assert not {0, 2} & set(tokens.tolist())
    assert torch.allclose(logprobs, policy_log_probs(logits, tokens, params), atol=1e-6)
    if params == SamplingParams(temperature=0.7):
        freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
        allowed = (logits[0] / 0.7).index_fill(0, torch.tensor([0, 2]), float("-inf")).softmax(-1)
        assert torch.allclose(freq, allowed, atol=0.03)


def test_scheduler_fills_free_slots_in_order_within_the_token_budget():
    sched = Scheduler(num_slots=4, max_prefill_tokens=10)
    sched.add([Request([2 * i, 2 * i + 1], [1] * 4, max_tokens=8) for i in range(3)])
    first = sched.admit(running=0)
    assert [r.seqs for r in first] == [[0, 1], [2, 3]] and [r.slots for r in first] == [[0, 1], [2, 3]]
    assert sched.admit(running=4) == []  # no free slots
    sched.release([2, 3])
    (third,) = sched.admit(running=2)
    assert third.seqs == [4, 5] and third.slots == [2, 3] and not sched.has_waiting
    with pytest.raises(ValueError, match="n=5 exceeds"):
        sched.add([Request(list(range(5)), [1], max_tokens=8)])


def test_scheduler_batches_admissions_until_an_eighth_of_the_slots_are_free():
    sched = Scheduler(num_slots=16, max_prefill_tokens=1000)
    sched.add([Request([i], [1, 2], max_tokens=8) for i in range(40)])
    assert len(sched.admit(running=0)) == 16
    sched.release([3])
    assert sched.admit(running=15) == []  # one free slot: wait for more, so one prefill serves several prompts
    sched.release([5])
    assert [r.slots for r in sched.admit(running=14)] == [[3], [5]]  # 2 = 16 // 8 free
    sched = Scheduler(num_slots=16, max_prefill_tokens=1000)
    sched.add([Request([i], [1], max_tokens=8) for i in range(17)])
    sched.admit(running=0)
    sched.release([0])
    assert len(sched.admit(running=15)) == 1  # the last waiting request needs only one slot


def test_scheduler_gathers_continuations_until_an_eighth_of_the_running_rows_wait():
    sched = Scheduler(num_slots=64, max_prefill_tokens=100)
    sched.add([Request([5], [7, 7], max_tokens=8, start=10, slots=[5])])
    assert sched.admit(running=16) == [] and sched.can_admit()  # 1 < 16 // 8: wait for another
    sched.add([Request([6], [7, 7], max_tokens=8, start=10, slots=[6])])
    assert [r.seqs for r in sched.admit(running=16)] == [[5], [6]]  # one prefill serves both
    sched.add([Request([7], [7, 7], max_tokens=8, start=10, slots=[7])])
    assert [r.seqs for r in sched.admit(running=0)] == [[7]]  # nothing runs: at once


def test_scheduler_admits_continuations_first_and_new_prompts_when_nothing_runs():
    sched = Scheduler(num_slots=16, max_prefill_tokens=100)
    sched.add([Request([i], [1, 2], max_tokens=8) for i in range(16)])
    assert len(sched.admit(running=0)) == 16
    sched.max_prefill_tokens = 6
    sched.release([0])  # one free slot: new prompts wait while rows run
    sched.add([Request([99], [1, 2, 3], max_tokens=8)])
    sched.add([Request([5], [7] * 4, max_tokens=8, start=10, slots=[5]),
               Request([6], [7] * 4, max_tokens=8, start=10, slots=[6])])
    assert sched.can_admit()
    first = sched.admit(running=10)
    assert [r.seqs for r in first] == [[5]]  # the second continuation passes the prefill token budget
    assert [r.seqs for r in sched.admit(running=10)] == [[6]]  # and the new prompt waits: 1 free slot
    assert [r.seqs for r in sched.admit(running=0)] == [[99]]  # nothing runs (all held): admit it
    assert not sched.can_admit()


def test_bucket_sizes_cover_every_batch():
    sizes = bucket_sizes(100)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert all(any(s >= b for s in sizes) for b in range(1, 101))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, GenerationConfig

    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        eos_token_id=3, bos_token_id=3, initializer_range=0.5)
    model = GPT2LMHeadModel(config)
    model.generation_config = GenerationConfig(eos_token_id=[3], pad_token_id=0)
    model.save_pretrained(path)
    return path


def test_unsupported_architecture_uses_the_hf_fallback(tiny_gpt2, caplog):
    from transformers import AutoModelForCausalLM

    with caplog.at_level("WARNING", logger="hybridflow.engine.rollout.hf_fallback"):
        engine = RolloutEngine.from_pretrained(tiny_gpt2, max_num_seqs=4)
    assert isinstance(engine, HFRolloutEngine) and engine.default_stop_ids == [3]
    # said once when built, with why, and once after the first generation, with the rate it reached
    (built,) = [r.getMessage() for r in caplog.records]
    assert "model_type 'gpt2' has no fast path (fast: llama, qwen2" in built and "transformers.generate" in built
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybridflow.engine.rollout.hf_fallback"):
        engine.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[]))
        engine.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[]))
    (rate,) = [r.getMessage() for r in caplog.records]
    assert rate.startswith("rollout through transformers.generate: 4 tokens in ") and "tok/s on cpu" in rate
    with pytest.raises(ValueError, match="engine='fast' has no path for model_type 'gpt2'"):
        RolloutEngine.from_pretrained(tiny_gpt2, engine="fast")
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[]))
    for prompt, (out,) in zip(prompts, free):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref and out.finish_reason == "length"
    greedy_n = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=12, stop_token_ids=[]))
    assert [[s.token_ids for s in row] for row in greedy_n] == [[o[0].token_ids] * 3 for o in free]
    stop = free[0][0].token_ids[2]
    stopped = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))
    assert stopped[0][0].token_ids == free[0][0].token_ids[:3] and stopped[0][0].finish_reason == "stop"
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_tokens=8, stop_token_ids=[],
                                                      seed=0))
    for prompt, samples in zip(prompts, sampled):
        assert len(samples) == 2
        for out in samples:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
            expected = (logits / 0.8).log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="prompt 0 has 128 tokens"):
        engine.generate([[5] * 128], SamplingParams())


def test_engine_hf_on_a_fast_architecture_matches_the_fast_engine(spread_model):
    path = spread_model("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    prompts = [[5, 6, 7], [8] * 11]
    hf = RolloutEngine.from_pretrained(path, engine="hf", max_num_seqs=4)
    fast = RolloutEngine.from_pretrained(path, engine="fast", max_num_seqs=4)
    assert isinstance(hf, HFRolloutEngine) and isinstance(fast, RolloutEngine)
    assert [o[0].token_ids for o in hf.generate(prompts, params)] == \
        [o[0].token_ids for o in fast.generate(prompts, params)]
    with pytest.raises(ValueError, match="engine='vllm' is invalid"):
        RolloutEngine.from_pretrained(path, engine="vllm")


def test_decode_attention_splits_a_row_only_when_rows_leave_the_gpu_idle():
    from hybridflow.engine.rollout.decode_attention import block_for, decode_splits

    assert decode_splits(rows=256, kv_heads=2, max_len=384, multiprocessors=132) == 1
    assert decode_splits(rows=64, kv_heads=2, max_len=4608, multiprocessors=132) == 1
    assert decode_splits(rows=8, kv_heads=2, max_len=8192, multiprocessors=132) == 8
    assert decode_splits(rows=1, kv_heads=1, max_len=1024, multiprocessors=132) == 4  # pieces >= 256 positions
    assert (block_for(64), block_for(128), block_for(256)) == (64, 32, 16)
