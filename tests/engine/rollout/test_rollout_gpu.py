"""GPU-only checks of the rollout engine (skipped on CPU): CUDA-graph decode (sampling and bookkeeping
inside the graph) equals eager decode, greedy and seeded, for one and several steps per sync; the fused
kernels (norm, silu, rotary + cache write, split-KV decode attention, the split sampler) equal their torch
references; and bf16 greedy tracks `transformers.generate`."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu


# qwen3: per-head q/k norms in place, then the fused kernels; olmo2: norms over the whole q and k and after each block;
# gemma3_text: sliding-window layers (8 tokens, shorter than the generations) in the decode kernels and flash;
# qwen3_5_text: linear-attention layers (flash-linear-attention's kernels) whose states the graphs update in place;
# qwen3_next: the same with its grouped projections and its experts' grouped GEMMs in the graphs
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "olmo2", "phi3", "gemma3_text", "qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(spread_model, dtype, arch):
    path = spread_model(arch)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14]]  # a bucket's size: the same GEMM shapes
    graphs = RolloutEngine.from_pretrained(path, device="cuda", dtype=dtype, max_num_seqs=8).generate(prompts, params)
    eager = RolloutEngine.from_pretrained(path, device="cuda", dtype=dtype, max_num_seqs=8,
                                          cuda_graphs=False).generate(prompts, params)
    assert [o[0].token_ids for o in graphs] == [o[0].token_ids for o in eager]


@pytest.mark.parametrize("window", [None, 5])
def test_flash_attention_within_a_sliding_window_equals_sdpa(window):
    """Packed prefill and several queries per row over the cache (a continuation) in bf16: flash's window arguments
    leave out what SDPA's narrowed masks leave out (Gemma 3's sliding layers; a window shorter than the rows)."""
    from hybridflow.engine.rollout.attention import AttnMeta, cache_attention, prefill_attention

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    lens = [3, 11, 7]
    q, k, v = randn(sum(lens), 4, 64), randn(sum(lens), 2, 64), randn(sum(lens), 2, 64)
    cu = torch.tensor([0, 3, 14, 21], dtype=torch.int32, device="cuda")
    got = [prefill_attention(q, k, v, AttnMeta(write_index=cu, cu_seqlens=cu, seqlens=lens, max_seqlen=max(lens)),
                             0.125, backend, window) for backend in ("flash", "sdpa")]
    torch.testing.assert_close(got[0], got[1], atol=2e-2, rtol=2e-2)
    max_len, slots = 16, torch.tensor([0, 1, 2], device="cuda")
    k_cache, v_cache = randn(4, max_len, 2, 64), randn(4, max_len, 2, 64)
    starts = (slots * max_len).to(torch.int32)
    queries = randn(8, 4, 64)  # 3, 1 and 4 new tokens at the ends of contexts of 9, 16 and 4

    def over_cache():
        return AttnMeta(write_index=starts, cu_seqlens=torch.cat([starts, starts[-1:] + max_len]),
                        cu_seqlens_q=torch.tensor([0, 3, 4, 8], dtype=torch.int32, device="cuda"), max_seqlen_q=4,
                        max_seqlen=max_len, context_lens=torch.tensor([9, 16, 4], dtype=torch.int32, device="cuda"),
                        slots=slots)

    got = [cache_attention(queries, k_cache, v_cache, over_cache(), 0.125, backend, window)
           for backend in ("flash", "sdpa")]
    torch.testing.assert_close(got[0], got[1], atol=2e-2, rtol=2e-2)


def test_the_busy_clock_times_the_gpu_work_of_the_steps_within_their_wall_time(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), device="cuda", max_num_seqs=8)
    session = engine.session(SamplingParams(temperature=1.0, max_tokens=64, stop_token_ids=[], seed=0))
    for i in range(6):
        session.add([5 + i, 6, 7])
    session.run()
    stats = session.stats
    assert 0 < stats["busy_s"] <= stats["prefill_s"] + stats["decode_s"]


@pytest.mark.parametrize("top_k", [-1, 3])
def test_in_graph_sampling_equals_eager_sampling_for_a_seed(spread_model, top_k):
    """4 rows (a captured bucket's size, so the GEMMs match): the fused sampler inside the graph (seed
    advanced on the device), or with top-k the eager sampler over the graph's logits, draws what the
    eager decode draws for the same seed; and one step per sync draws the same as eight."""
    path = spread_model("qwen2")
    params = SamplingParams(n=2, temperature=0.8, top_k=top_k, max_tokens=24, stop_token_ids=[], seed=11)
    prompts = [[5, 6, 7], [8] * 9]
    runs = [RolloutEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=4, **kwargs)
            .generate(prompts, params) for kwargs in (dict(), dict(cuda_graphs=False), dict(decode_steps_per_sync=1))]
    tokens = [[s.token_ids for row in run for s in row] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[0][0] != tokens[0][1]  # the two samples of a prompt differ
    for other in runs[1:]:
        torch.testing.assert_close(torch.tensor([s.logprobs for row in other for s in row]),
                                   torch.tensor([s.logprobs for row in runs[0] for s in row]), atol=1e-3, rtol=0)


def test_several_steps_per_sync_with_stops_equal_one_step_per_sync_on_graphs(spread_model):
    path = spread_model("llama")
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14], [15]]
    one, many = (RolloutEngine.from_pretrained(path, device="cuda", max_num_seqs=3, decode_steps_per_sync=k)
                 for k in (1, 8))
    free = one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[]))
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            stop_token_ids=[free[0][0].token_ids[3], free[2][0].token_ids[9]])
    a, b = one.generate(prompts, params), many.generate(prompts, params)
    assert [o[0].token_ids for o in a] == [o[0].token_ids for o in b]
    assert [o[0].finish_reason for o in a] == [o[0].finish_reason for o in b]
    assert "stop" in [o[0].finish_reason for o in b]


def test_fused_kernels_match_torch_references():
    from hybridflow.engine.rollout import kernels

    h, d = torch.randn(2, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    out, total = kernels.add_rms_norm(h, d, w, 1e-6)
    torch.testing.assert_close(total, h + d)
    torch.testing.assert_close(out, kernels._rms_norm_torch(h + d, w, 1e-6), atol=2e-2, rtol=2e-2)
    olmo2 = kernels.add_rms_norm(h, d, w, 1e-6, round_first=False)[0]  # OLMo 2's: scaled in fp32, rounded once
    torch.testing.assert_close(olmo2, kernels._rms_norm_torch(h + d, w, 1e-6, False), atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    qkv = torch.randn(5, 8 * 128, device="cuda", dtype=torch.bfloat16)  # 4 q, 2 k and 2 v heads of 128
    heads, head_weight = qkv.clone().view(5, 8, 128), torch.randn(128, device="cuda", dtype=torch.bfloat16)
    kernels.head_rms_norm_(heads[:, :6], head_weight, 1e-6)
    torch.testing.assert_close(heads[:, :6], kernels._rms_norm_torch(qkv.view(5, 8, 128)[:, :6], head_weight, 1e-6),
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(heads[:, 6:], qkv.view(5, 8, 128)[:, 6:])


def test_sleep_gives_memory_back_and_wake_keeps_the_graphs(spread_model):
    from safetensors.torch import load_file

    path = spread_model("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    prompts = [[5, 6, 7], [8] * 9, [9, 10]]
    engine = RolloutEngine.from_pretrained(path, device="cuda", max_num_seqs=8)
    assert engine.kv.keeps_address, "this GPU should support CUDA virtual memory management"
    before = [o[0].token_ids for o in engine.generate(prompts, params)]
    graphs, k_address = engine.graphs, engine.kv.k.data_ptr()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * engine.kv.bytes
    hog = torch.empty(engine.kv.bytes, dtype=torch.uint8, device="cuda")  # someone else uses the memory
    del hog
    engine.wake()
    assert engine.graphs is graphs and engine.kv.k.data_ptr() == k_address
    assert [o[0].token_ids for o in engine.generate(prompts, params)] == before
    engine.sleep(offload_weights=True)  # weights move: the graphs must be captured again
    assert engine.graphs is None
    weights = list(engine.model.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in weights)
    engine.wake()
    assert engine.graphs is not graphs and all(p.is_cuda for p in weights)
    assert [o[0].token_ids for o in engine.generate(prompts, params)] == before
    engine.sleep(offload_weights=True)  # a sync into offloaded weights brings them back before copying
    engine.load_weights((k, v.to("cuda")) for k, v in load_file(str(path / "model.safetensors")).items())
    assert not engine.weights_offloaded and all(p.is_cuda for p in weights)
    engine.wake()
    assert [o[0].token_ids for o in engine.generate(prompts, params)] == before


def test_continuation_over_the_flash_cache_equals_one_shot_prefill(spread_model):
    """bf16 on CUDA: continuation prefill through flash attention over the slot cache (seqused_k, causal
    aligned bottom-right), then CUDA-graph decode, gives the turn a fresh one-shot prefill gives."""
    path = spread_model("qwen2")
    engine = RolloutEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
    prompts, appended = [[5, 6, 7], [8] * 9, [9, 10]], [[40, 41, 42, 43], [7] * 11, [50]]
    session = engine.session(params, hold=True)
    seqs = [session.add(p)[0] for p in prompts]
    first = session.run()
    for seq, extra in zip(seqs, appended):
        session.extend(seq, extra)
    second = session.run()
    assert session.stats["reused_tokens"] == sum(len(p) + 8 - 1 for p in prompts)
    for seq, prompt, extra in zip(seqs, prompts, appended):
        whole = prompt + first[seq].token_ids + extra
        (alone,), = engine.generate([whole], params)
        assert second[seq].token_ids[:4] == alone.token_ids[:4]
        torch.testing.assert_close(torch.tensor(second[seq].logprobs[:4]), torch.tensor(alone.logprobs[:4]),
                                   atol=5e-2, rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernels_equal_the_general_path(splits):
    """The fused rotary + cache write and the split-KV decode attention give what rotary, `write_kv` and
    SDPA over the cache give (bf16; one row of length 1, rows of lengths within and past one block); so
    does the one-kernel `rotary_decode_attention`, which writes the same cache and leaves qkv as it was."""
    from hybridflow.engine.rollout import decode_attention as da
    from hybridflow.engine.rollout import kernels
    from hybridflow.engine.rollout.attention import AttnMeta, cache_attention, write_kv

    torch.manual_seed(0)
    heads, kv_heads, dim, max_len, dev, dt = 14, 2, 64, 1024, "cuda", torch.bfloat16
    cache = torch.randn(2, 7, max_len, kv_heads, dim, device=dev, dtype=dt)
    slots = torch.tensor([4, 0, 2, 6], device=dev)
    lens = torch.tensor([1, 63, 700, 1024], device=dev, dtype=torch.int32)
    positions = (lens - 1).long()
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, device=dev, dtype=dt)
    angles = torch.randn(max_len, dim // 2, device=dev)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    meta = AttnMeta(write_index=slots * max_len + positions, max_seqlen=max_len, context_lens=lens, slots=slots,
                    cu_seqlens_q=torch.arange(5, device=dev, dtype=torch.int32))
    ref_qkv, (k_ref, v_ref) = qkv.clone(), cache.clone()
    qk = ref_qkv[:, :(heads + kv_heads) * dim].view(4, heads + kv_heads, dim)
    kernels.rotary_(qk, positions, cos, sin)
    write_kv(k_ref, v_ref, qk[:, heads:], ref_qkv[:, (heads + kv_heads) * dim:].view(4, kv_heads, dim), meta)
    ref = cache_attention(qk[:, :heads], k_ref, v_ref, meta, dim ** -0.5, "sdpa")
    one_cache, one_qkv = cache.clone(), qkv.clone()
    one = da.rotary_decode_attention(one_qkv, cos, sin, *one_cache, slots, lens, dim ** -0.5, splits, heads)
    assert torch.equal(one_qkv, qkv) and torch.equal(one_cache, torch.stack([k_ref, v_ref]))
    torch.testing.assert_close(one.float(), ref.float(), atol=2e-2, rtol=2e-2)
    k_cache, v_cache = cache
    da.rotary_store_(qkv, positions, cos, sin, k_cache, v_cache, meta.write_index, heads, kv_heads)
    assert torch.equal(qkv, ref_qkv) and torch.equal(cache, torch.stack([k_ref, v_ref]))
    q = qkv[:, :heads * dim].view(4, heads, dim)
    out = da.decode_attention(q, k_cache, v_cache, slots, lens, dim ** -0.5, splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_split_sampler_takes_the_lowest_id_of_equal_scores():
    from hybridflow.engine.rollout import kernels

    logits = torch.zeros(3, 151936, device="cuda")
    logits[:, 150000] = logits[:, 9000] = logits[:, 9001] = 5.0
    one, seed = torch.ones(1, device="cuda"), torch.tensor([7], device="cuda")
    tokens, logprobs = kernels.sample_plain(logits, one, seed, True)
    assert tokens.tolist() == [9000] * 3
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[:, 9000], atol=1e-3, rtol=0)


def test_split_sampler_draws_from_the_softmax_across_pieces():
    """Inverse-CDF sampling over a 151,936-token vocabulary (19 pieces): the frequencies of tokens in the
    first, a middle, a boundary and the last piece, and of the uniform rest piece by piece, match
    softmax(logits / T) within 5 standard deviations; log-probs are log_softmax(logits / T)."""
    from hybridflow.engine.rollout import kernels

    vocab, rows, temp = 151936, 400_000, 0.7
    probs = torch.full((vocab,), 0.1 / (vocab - 4), dtype=torch.float64)
    named = torch.tensor([10, 8192, 60000, vocab - 1])
    probs[named] = torch.tensor([0.3, 0.15, 0.25, 0.2], dtype=torch.float64)
    logits = (probs.log() * temp).float().cuda()
    tokens, logprobs = kernels.sample_plain(logits[None].expand(rows, vocab), torch.tensor([1 / temp], device="cuda"),
                                            torch.tensor([11], device="cuda"), False)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = (logits.double() / temp).softmax(-1).cpu()
    width = kernels.SAMPLE_WIDTH
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[named] = False
    groups = [counts[named], torch.stack([counts[i:i + width][rest[i:i + width]].sum() for i in range(0, vocab, width)])]
    wanted = [expected[named], torch.stack([expected[i:i + width][rest[i:i + width]].sum() for i in range(0, vocab, width)])]
    for got, p in zip(groups, wanted):
        sigma = (rows * p * (1 - p)).sqrt()
        assert ((got - rows * p).abs() <= 5 * sigma + 1).all(), (got, rows * p)
    ref = (logits / temp).log_softmax(-1)[tokens]
    torch.testing.assert_close(logprobs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_a_hybrid_engine_sleeps_and_wakes_on_cuda(spread_model, arch):
    """A hybrid model's K/V sit in the stable buffer (CUDA virtual memory) and its states beside it: wake maps the
    buffer again as K and V alone (it once split K/V plus the states' bytes, and failed), and generation is as before."""
    engine = RolloutEngine.from_pretrained(spread_model(arch, layers=4), device="cuda", dtype=torch.float32,
                                           max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])
    prompts = [[5, 6, 7], [8] * 9]
    before = [o[0].token_ids for o in engine.generate(prompts, params)]
    engine.sleep()
    engine.wake()
    kv = engine.kv
    assert kv.keeps_address is False and kv.mapped_bytes == kv.k.nbytes + kv.v.nbytes
    assert kv.bytes == kv.mapped_bytes + kv.conv.nbytes + kv.recurrent.nbytes
    assert [o[0].token_ids for o in engine.generate(prompts, params)] == before


def test_hybrid_linear_attention_on_cuda_tracks_transformers(spread_model):
    """Qwen3.5's pattern (three linear-attention layers, then a full one) on CUDA, where both engines run
    flash-linear-attention's chunked kernel over a prompt and its recurrent kernel over each decoded token: fp32
    greedy equals transformers' greedy, and each chosen token's log-prob equals the one transformers' own
    prefill + decode gives it. Against transformers' full forward (the chunked kernel over every token) the bound is
    looser: fla's chunked kernels multiply in TF32 (`tl.dot` without `allow_tf32=False`, 10-bit mantissas) where the
    recurrent one multiplies in fp32, so the two ways differ by TF32's rounding in both engines alike (8.9e-3 seen
    on an H100)."""
    pytest.importorskip("fla", reason="flash-linear-attention (the `linear` extra) runs Qwen3.5 on CUDA")
    from transformers import AutoModelForCausalLM

    path = spread_model("qwen3_5_text", layers=4)
    prompts = [[5, 6, 7], [8] * 70, [9, 10, 11, 12]]  # 73 tokens: a prefill over one chunk of the delta rule (64)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    outs = RolloutEngine.from_pretrained(path, device="cuda", dtype=torch.float32, max_num_seqs=4).generate(prompts,
                                                                                                              params)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, outs):
        tokens = out[0].token_ids
        with torch.no_grad():
            steps = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=len(tokens), do_sample=False,
                                   min_new_tokens=len(tokens), output_logits=True, return_dict_in_generate=True)
            full = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        assert steps.sequences[0, len(prompt):].tolist() == tokens
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        incremental = torch.cat(steps.logits).float().log_softmax(-1).gather(1, chosen)[:, 0].cpu()
        torch.testing.assert_close(torch.tensor(out[0].logprobs), incremental, atol=2e-3, rtol=0)
        torch.testing.assert_close(torch.tensor(out[0].logprobs), full.log_softmax(-1).gather(1, chosen)[:, 0].cpu(),
                                   atol=2e-2, rtol=0)
