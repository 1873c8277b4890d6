"""The rollout engine's own Triton kernels (the decode step's norm, rotary and SwiGLU, the decode attention, the
MoE experts' grouped GEMM) run by Triton's interpreter on CPU tensors: run only by `test_kernels_interpreted.py`,
in a process with TRITON_INTERPRET=1. Each must compute what the engine's PyTorch path (or a plain softmax
attention) computes, to rounding: this checks their indexing, masks and launch arguments in every `make test`,
where the GPU tests (`tests/engine/rollout/test_rollout_gpu.py`, `test_moe_gpu.py`) run only on a device."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from hybridflow.engine import invariant
from hybridflow.engine.rollout import decode_attention, kernels
from hybridflow.engine.rollout.grouped_gemm import LAYOUT_CHUNK, block_layout, expert_mlp

HEADS, KV_HEADS, DIM = 4, 2, 16


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _rope_tables(max_len: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, dim] fp32 of a Llama rotary embedding with heads of `dim` (`invariant.rope_table`)."""
    return invariant.rope_table(LlamaConfig(hidden_size=2 * dim, num_attention_heads=2), max_len)


def _rotated(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    kernels.rotary_(out, positions, cos, sin)  # CPU tensors: the torch path
    return out


def _softmax_attention(q, k_cache, v_cache, slots, context_lens, scale, window=None):
    """Each row's heads over its slot's first context_lens positions (the last `window` of them where given); KV
    heads shared by HEADS / KV_HEADS."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for row, (slot, length) in enumerate(zip(slots.tolist(), context_lens.tolist())):
        first = max(0, length - window) if window else 0
        k = k_cache[slot, first:length].repeat_interleave(group, dim=1)
        v = v_cache[slot, first:length].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row], k) * scale, dim=-1)
        out[row] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def test_row_kernels_compute_the_torch_path(monkeypatch):
    h, delta, weight = _randn(6, 96, seed=1), _randn(6, 96, seed=2), _randn(96, seed=3)  # 96: a masked block
    gate_up = _randn(5, 2 * 1500, seed=4)  # past one block of 1,024 columns
    x, positions = _randn(5, 3, 32, seed=5), torch.tensor([0, 4, 9, 2, 7])
    cos, sin = _rope_tables(12, 32)
    want = (kernels.add_rms_norm(h, delta, weight, 1e-6), kernels.add_rms_norm(h, None, weight, 1e-6),
            kernels.silu_mul(gate_up), _rotated(x, positions, cos, sin),
            kernels.add_rms_norm(h, delta, weight, 1e-6, plus_one=True))
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    for got, expected in zip(kernels.add_rms_norm(h, delta, weight, 1e-6), want[0]):
        _close(got, expected)
    _close(kernels.add_rms_norm(h, None, weight, 1e-6)[0], want[1][0])
    # OLMo 2's norm, scaled before its rounding: the same in fp32 (the interpreter's bf16 rounds otherwise than a
    # GPU's, so the bf16 difference is test_rollout_gpu.py's)
    _close(kernels.add_rms_norm(h, delta, weight, 1e-6, round_first=False)[0], want[0][0])
    _close(kernels.add_rms_norm(h, delta, weight, 1e-6, plus_one=True)[0], want[4][0])  # Gemma 3's, by 1 + weight
    _close(kernels.silu_mul(gate_up), want[2])
    _close(_rotated(x, positions, cos, sin), want[3])


def test_head_norms_in_place_inside_the_fused_projection(monkeypatch):
    """Qwen3's per-head q/k norms on the q heads of a fused projection row, OLMo 2's over the whole k (one head as
    wide as k, scaled before its rounding), and Gemma 3's per head by 1 + weight on the v heads' columns standing
    in for a third kind: normed in place as the torch reference norms a copy; the other columns are left as they
    were."""
    qkv = _randn(5, (HEADS + 2 * KV_HEADS) * DIM, seed=1)
    weight, whole = _randn(DIM, seed=2), _randn(KV_HEADS * DIM, seed=3)
    heads, k = qkv.view(5, -1, DIM), slice(HEADS * DIM, (HEADS + KV_HEADS) * DIM)
    want = qkv.clone()
    want.view(5, -1, DIM)[:, :HEADS] = kernels._rms_norm_torch(heads[:, :HEADS], weight, 1e-6)
    want[:, k] = kernels._rms_norm_torch(qkv[:, k], whole, 1e-6, round_first=False)
    want.view(5, -1, DIM)[:, HEADS + KV_HEADS:] = kernels._rms_norm_torch(heads[:, HEADS + KV_HEADS:], weight, 1e-6,
                                                                          plus_one=True)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    kernels.head_rms_norm_(heads[:, :HEADS], weight, 1e-6)
    kernels.head_rms_norm_(qkv[:, k].view(5, 1, -1), whole, 1e-6, round_first=False)
    kernels.head_rms_norm_(heads[:, HEADS + KV_HEADS:], weight, 1e-6, plus_one=True)
    _close(qkv, want)


def _heads(qkv: torch.Tensor) -> torch.Tensor:
    """The fused projection's rows [T, (H + 2 Hkv) * D] as [T, H + 2 Hkv, D]."""
    return qkv.view(qkv.shape[0], -1, DIM)


def _cache(slots: int, max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (slots + 1, max_len, KV_HEADS, DIM)
    return _randn(*shape, seed=seed), _randn(*shape, seed=seed + 1)


def test_decode_attention_whole_and_split_equals_a_softmax_over_the_slot():
    k_cache, v_cache = _cache(5, 40, seed=1)
    slots, context_lens = torch.tensor([2, 0, 4]), torch.tensor([1, 17, 40], dtype=torch.int32)
    q = _randn(3, HEADS, DIM, seed=3)
    for window in (None, 9):  # the whole context, then a sliding window shorter than two of the rows
        want = _softmax_attention(q, k_cache, v_cache, slots, context_lens, 0.3, window)
        for splits in (1, 3):  # one piece of each row's context, then flash-decoding's pieces merged by their lse
            _close(decode_attention.decode_attention(q, k_cache, v_cache, slots, context_lens, 0.3, splits, block=16,
                                                     window=window), want)


def test_rotary_store_then_the_fused_decode_step():
    """Prefill's rotary_store_ rotates q and k in place and writes k and v at their flat positions; the fused
    decode kernel rotates in registers (at context_lens - 1, or shifted by per-row rope offsets), writes the new k and
    v at context_lens - 1, and attends over them."""
    max_len, width = 24, (HEADS + 2 * KV_HEADS) * DIM
    cos, sin = _rope_tables(max_len, DIM)
    qkv, positions = _randn(4, width, seed=1), torch.tensor([0, 5, 23, 9])
    write_index = torch.tensor([0 * max_len + 0, 3 * max_len + 5, 1 * max_len + 23, 2 * max_len + 9])
    k_cache, v_cache = torch.zeros(4, max_len, KV_HEADS, DIM), torch.zeros(4, max_len, KV_HEADS, DIM)
    rotated = _rotated(_heads(qkv)[:, :HEADS + KV_HEADS], positions, cos, sin)
    stored = qkv.clone()
    decode_attention.rotary_store_(stored, positions, cos, sin, k_cache, v_cache, write_index, HEADS, KV_HEADS)
    _close(_heads(stored)[:, :HEADS + KV_HEADS], rotated)
    _close(_heads(stored)[:, HEADS + KV_HEADS:], _heads(qkv)[:, HEADS + KV_HEADS:])
    _close(k_cache.view(-1, KV_HEADS, DIM)[write_index], rotated[:, HEADS:])
    _close(v_cache.view(-1, KV_HEADS, DIM)[write_index], _heads(qkv)[:, HEADS + KV_HEADS:])

    k_cache, v_cache = _cache(3, max_len, seed=2)
    slots, context_lens = torch.tensor([1, 3, 0]), torch.tensor([1, 20, 24], dtype=torch.int32)
    step = _randn(3, width, seed=3)
    # rope_offsets (a vision prompt's rope delta): rotated at the cache position + offset, stored at the cache position
    for offsets in (None, torch.tensor([0, -7, -20])):
        turns = context_lens.long() - 1 + (0 if offsets is None else offsets)
        new = _rotated(_heads(step)[:, :HEADS + KV_HEADS], turns, cos, sin)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        k_want[slots, context_lens.long() - 1] = new[:, HEADS:]
        v_want[slots, context_lens.long() - 1] = _heads(step)[:, HEADS + KV_HEADS:]
        for window, splits in ((None, 1), (None, 2), (6, 1), (6, 2)):  # 6: a sliding window shorter than two rows
            want = _softmax_attention(new[:, :HEADS], k_want, v_want, slots, context_lens, 0.25, window)
            k_got, v_got = k_cache.clone(), v_cache.clone()
            out = decode_attention.rotary_decode_attention(step, cos, sin, k_got, v_got, slots, context_lens, 0.25,
                                                           splits, HEADS, window, offsets)
            _close(out, want)
            _close(k_got, k_want)
            _close(v_got, v_want)


def test_moe_grouped_gemm_equals_the_gather_path():
    """The experts' Triton kernel (`moe_kernel=auto` on CUDA) at a decode row, ragged token counts and tiles whose
    blocks hold several or no pairs of an expert."""
    hidden, inter = 32, 24
    for tokens, experts, k, tiles in ((1, 8, 3, None), (5, 4, 2, dict(block_m=16, block_n=16, block_k=16)),
                                      (37, 8, 2, dict(block_m=16, block_n=32, block_k=16))):
        x, weights = _randn(tokens, hidden, seed=tokens), torch.rand(tokens, k)
        gate_up, down = _randn(experts, 2 * inter, hidden, seed=1) / 4, _randn(experts, hidden, inter, seed=2) / 4
        ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
        want = expert_mlp(x, weights, ids, gate_up, down, kernels.silu_mul, "gather")
        _close(expert_mlp(x, weights, ids, gate_up, down, kernels.silu_mul, "triton", tiles), want)


def _sorted_layout(ids: list[int], experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The layout `block_layout` promises, written out: each expert's pairs in their order, its run starting at
    a multiple of block_m, empty slots holding P; a block's expert, -1 past the last run."""
    size = -(-(len(ids) + experts * (block_m - 1)) // block_m) * block_m
    slots, owners = [], []
    for e in range(experts):
        run = [p for p, chosen in enumerate(ids) if chosen == e]
        padded = -(-len(run) // block_m) * block_m
        slots += run + [len(ids)] * (padded - len(run))
        owners += [e] * (padded // block_m)
    return slots + [len(ids)] * (size - len(slots)), owners + [-1] * (size // block_m - len(owners))


def test_block_layout_sorts_the_pairs_by_expert_without_a_sort():
    """One decode row, no pairs, pairs over several of the kernels' chunks, an expert count that is no power of
    two, experts left without pairs, and experts holding more than one block."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.tensor([3, 0, 7]), 8, 16), (torch.tensor([], dtype=torch.long), 4, 16), (torch.randint(0, 6, (3 * LAYOUT_CHUNK + 5,), generator=gen), 6, 16),
             (torch.randint(0, 40, (2 * LAYOUT_CHUNK,), generator=gen) % 9, 40, 32)]
    for ids, experts, block_m in cases:
        slot_pair, block_expert = block_layout(ids, experts, block_m)
        want_slots, want_owners = _sorted_layout(ids.tolist(), experts, block_m)
        assert slot_pair.tolist() == want_slots and block_expert.tolist() == want_owners


def test_the_engine_on_its_triton_paths_generates_what_its_torch_paths_do(monkeypatch, tiny_model_factory):
    """Whole generations of a tiny Qwen2, Qwen3, OLMo 2, Phi-3 (whole and partial rotary), Gemma 3 and Qwen3.5 (spread
    weights) through every Triton path the engine takes on a GPU (Qwen3.5's linear layers stepping their slots'
    states in place, `delta_step`): the norms (Qwen3's per-head q/k norms in place in the fused
    projection, OLMo 2's scaled before their rounding, over the whole q and k and after each block, Gemma 3's by
    1 + weight), rotary with the cache write in prefill, the fused rotary-and-decode attention (Gemma 3's sliding
    layers within their 8-token window, each layer reading its columns of the local and global tables side by
    side), SwiGLU and the sampler; greedy tokens and their log-probs against the same engine on its torch paths."""
    from hybridflow.engine.rollout import RolloutEngine, SamplingParams, attention, model, sampler
    from tests.engine.rollout.conftest import SPREAD_SIZES, spread_weights, with_config

    prompts, params = [[5, 6, 7, 8, 9], [10, 11, 12], [20] * 11], SamplingParams(temperature=0.0, max_tokens=5,
                                                                                stop_token_ids=[])
    paths = {arch: spread_weights(tiny_model_factory(arch), tiny_model_factory(arch).parent / f"spread_{arch}")
             for arch in ("qwen2", "qwen3", "olmo2", "phi3")}
    paths["qwen3_5_text"] = spread_weights(tiny_model_factory("qwen3_5_text"),
                                           tiny_model_factory("qwen3_5_text").parent / "spread_qwen3_5_text")
    untied = tiny_model_factory("gemma3_text", **SPREAD_SIZES["gemma3_text"])
    paths["gemma3_text"] = spread_weights(untied, untied.parent / "spread_gemma3_text")
    partial = paths["phi3"].parent / "partial_phi3"
    partial.mkdir(exist_ok=True)
    paths["phi3 partial rotary"] = with_config(paths["phi3"], partial, partial_rotary_factor=0.5,
                                               rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                                "rope_type": "default"})
    for arch, path in paths.items():
        want = RolloutEngine.from_pretrained(path, max_num_seqs=4).generate(prompts, params)
        with monkeypatch.context() as patch:
            for module in (kernels, model, sampler):
                patch.setattr(module, "use_triton", lambda t: True)
            for module in (attention, model):  # the decode kernels, which a GPU's flash backend selects
                patch.setattr(module, "decodes_in_triton", lambda meta, backend, head_dim: meta.reads_cache
                              and meta.max_seqlen_q == 1 and decode_attention.supported(head_dim))
            patch.setattr(attention, "_multiprocessors", lambda device: 4)
            got = RolloutEngine.from_pretrained(path, max_num_seqs=4).generate(prompts, params)
        for (a,), (b,) in zip(got, want):
            assert a.token_ids == b.token_ids, arch
            _close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_fp8_row_quantization_computes_the_torch_path(monkeypatch):
    """The FP8 rollout's quantizer (`fp8.quantize_rows`) over rows of one tile, of several with a masked last one,
    and an all-zero row. The interpreter's float -> e4m3 conversion rounds up without carrying into the exponent
    (x / scale just under 2^k becomes 2^(k-1), or 7 x 2^-9 at the subnormal edge, where the GPU's
    `cvt.rn.satfinite` gives 2^k): those entries, and only those, may differ."""
    from hybridflow.engine.rollout import fp8

    x = _randn(5, 4096 + 100, seed=20) * torch.tensor([1e-3, 1.0, 40.0, 0.0, 3.0])[:, None]
    small = _randn(3, 96, seed=21)
    want = []
    for rows in (x, small):
        q, scale = torch.empty(rows.shape, dtype=fp8.FP8), torch.empty(rows.shape[0])
        fp8.quantize_rows(rows, q, scale)
        want.append((q.float(), scale))
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    for rows, (q_want, scale_want) in zip((x, small), want):
        q, scale = torch.empty(rows.shape, dtype=fp8.FP8), torch.empty(rows.shape[0])
        fp8.quantize_rows(rows, q, scale)
        torch.testing.assert_close(scale, scale_want, atol=0, rtol=1e-6)
        power_of_two = q_want.abs() == 2 ** q_want.abs().clamp(min=1e-30).log2().round()
        got = q.float()
        carry_lost = power_of_two & (got * q_want > 0) & (got.abs() < q_want.abs()) & (2 * got.abs() >= q_want.abs())
        assert ((got == q_want) | carry_lost).all()
        assert carry_lost.float().mean() < 0.05


def test_the_delta_rule_step_over_slots_equals_the_torch_path(monkeypatch):
    """The Gated DeltaNet decode step in place over the cache's slots (`delta_step.step_`): key heads shared by two
    value heads each, K and V not powers of two (masked blocks), a fresh row (zero states), a finished row (its slot
    keeps its state) and a slot no row reads (untouched): outputs and every slot's state as the torch path has them."""
    from hybridflow.engine.rollout import delta_step

    rows, heads, value_heads, key_dim, value_dim, slots_n = 4, 2, 4, 24, 40, 6
    q, k = _randn(rows, heads, key_dim, seed=1), _randn(rows, heads, key_dim, seed=2)
    v = _randn(rows, value_heads, value_dim, seed=3)
    g = -torch.rand(rows, value_heads, generator=torch.Generator().manual_seed(4))
    beta = torch.rand(rows, value_heads, generator=torch.Generator().manual_seed(5))
    states = _randn(slots_n, value_heads, key_dim, value_dim, seed=6)
    slots, fresh = torch.tensor([4, 0, 2, 5]), torch.tensor([False, True, False, False])
    live = torch.tensor([True, True, False, True])
    want_states = states.clone()
    want = delta_step.step_(q, k, v, g, beta, want_states, slots, fresh, live)
    assert torch.equal(want_states[2], states[2]) and torch.equal(want_states[1], states[1])  # finished; unread
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    got_states = states.clone()
    _close(delta_step.step_(q, k, v, g, beta, got_states, slots, fresh, live), want)
    _close(got_states, want_states)
