"""The invariant ops (`hybridflow.engine.invariant`): a row's result does not depend on the rows beside it, on
how a batch is split, or (attention) on whether its query runs alone, in a prefill or as a continuation; and
each op computes what its plain PyTorch counterpart does, up to rounding. On the CPU the PyTorch twins run;
the same checks run the Triton kernels on a GPU (bf16 and fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine import invariant
from hybridflow.engine.invariant.torch_ops import tree_sum

DEVICES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
           pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu),
           pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]


def _randn(*shape, device="cpu", dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def test_the_elementwise_kernels_the_cpu_twins_use_are_position_invariant():
    """The CPU twins rest on this: these torch kernels give an element the same bits wherever it sits in a
    tensor (torch's silu does not: its vector body and scalar tail differ, so the twins build it from exp)."""
    x = _randn(4099, seed=1) * 8
    for op in (torch.exp, torch.cos, torch.sin, lambda t: torch.log(t.abs() + 1e-3),
               lambda t: torch.rsqrt(t.abs() + 1e-3), lambda t: t / (1.0 + torch.exp(-t))):
        whole = op(x)
        for start, size in ((0, 1), (5, 7), (13, 33), (4090, 9), (100, 1000)):
            assert torch.equal(op(x[start:start + size].clone()), whole[start:start + size])


def test_tree_sum_does_not_depend_on_padding():
    x = _randn(3, 37, seed=2)
    assert torch.equal(tree_sum(F.pad(x, (0, 91))), tree_sum(x))
    assert torch.allclose(tree_sum(x.double()), x.double().sum(-1))


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_linear_rows_and_columns_do_not_depend_on_the_batch(device, dtype):
    x, w, b = _randn(150, 96, device=device, dtype=dtype), _randn(200, 96, device=device, dtype=dtype, seed=1), \
        _randn(200, device=device, dtype=dtype, seed=2)
    y = invariant.linear(x, w, b)
    assert torch.allclose(y.float(), F.linear(x.float(), w.float(), b.float()), atol=0.5 if dtype != torch.float32
                          else 1e-4)
    for rows in (slice(7, 8), slice(3, 70), slice(100, 150)):
        assert torch.equal(invariant.linear(x[rows], w, b), y[rows])
    # a fused projection's columns (q|k|v) equal the projections apart
    assert torch.equal(torch.cat([invariant.linear(x, w[:120], b[:120]), invariant.linear(x, w[120:], b[120:])], 1), y)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_row_ops_do_not_depend_on_the_batch(device, dtype):
    h, weight = _randn(40, 96, device=device, dtype=dtype), 1 + 0.1 * _randn(96, device=device, dtype=dtype, seed=1)
    normed = invariant.rms_norm(h, weight, 1e-6)
    reference = weight * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.allclose(normed.float(), reference.float(), atol=0.05 if dtype != torch.float32 else 1e-5)
    assert torch.equal(invariant.rms_norm(h[9:10], weight, 1e-6), normed[9:10])
    gate, up = _randn(40, 64, device=device, dtype=dtype, seed=3), _randn(40, 64, device=device, dtype=dtype, seed=4)
    act = invariant.silu_mul(gate, up)
    assert torch.allclose(act.float(), (F.silu(gate.float()) * up.float()), atol=0.05 if dtype != torch.float32
                          else 1e-5)
    assert torch.equal(invariant.silu_mul(gate[5:9], up[5:9]), act[5:9])
    logits, tokens = _randn(12, 1000, device=device, dtype=dtype, seed=5) * 4, torch.arange(12, device=device) * 7
    scale = invariant.inverse_temperature(0.7, device)
    logp, lse = invariant.token_log_probs(logits, tokens, scale)
    want = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logp, want, atol=1e-4)
    assert torch.equal(invariant.token_log_probs(logits[3:4], tokens[3:4], scale)[0], logp[3:4])


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("n", [64, 576, 896])
def test_the_fused_residual_add_and_norm_are_the_add_and_the_norm(device, dtype, n):
    """The rollout's `add_rms_norm` gives the bits of the trainer's add and `rms_norm` apart (SmolLM2's and the
    0.5B shape's hidden sizes among the widths), so the engine fuses them (`add_rms_norm_holds`)."""
    x, delta = _randn(37, n, device=device, dtype=dtype, seed=1), _randn(37, n, device=device, dtype=dtype, seed=2)
    weight = _randn(n, device=device, dtype=dtype, seed=3)
    normed, total = invariant.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta) and torch.equal(normed, invariant.rms_norm(x + delta, weight, 1e-5))
    assert invariant.add_rms_norm_holds(dtype, n, torch.device(device))

@pytest.mark.parametrize("device, dtype", DEVICES)
def test_rotary_in_place_equals_out_of_place_and_the_table_is_length_invariant(device, dtype, tiny_qwen2):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen2)
    cos, sin = invariant.rope_table(config, 300, device)
    short = invariant.rope_table(config, 50, device)
    assert torch.equal(short[0], cos[:50]) and torch.equal(short[1], sin[:50])
    positions = torch.tensor([0, 5, 49, 299], device=device)
    x = _randn(4, 6, 16, device=device, dtype=dtype)
    rotated = invariant.rotary(x, cos[positions], sin[positions])
    in_place = x.clone()
    invariant.rotary(in_place, cos[positions], sin[positions], out=in_place)
    assert torch.equal(in_place, rotated)
    half = x.float().chunk(2, -1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    assert torch.allclose(rotated.float(), x.float() * c + torch.cat([-half[1], half[0]], -1) * s,
                          atol=0.05 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_rotary_store_is_the_rotary_and_two_cache_copies(device, dtype, tiny_qwen2):
    """The rollout's fused q|k|v heads: q and k rotated in place as `rotary` rotates them, the rotated k and the v
    heads written to their cache rows, nothing else of the stores touched."""
    from transformers import AutoConfig

    cos, sin = invariant.rope_table(AutoConfig.from_pretrained(tiny_qwen2), 64, device)
    heads, kv_heads, positions = 4, 2, torch.tensor([0, 9, 33, 63, 17], device=device)
    x = _randn(5, heads + 2 * kv_heads, 16, device=device, dtype=dtype)
    index = torch.tensor([3, 7, 0, 19, 11], device=device)
    k_store, v_store = (_randn(20, kv_heads, 16, device=device, dtype=dtype, seed=s) for s in (1, 2))
    want, want_k, want_v = x.clone(), k_store.clone(), v_store.clone()
    qk = want[:, :heads + kv_heads]
    invariant.rotary(qk, cos[positions], sin[positions], out=qk)
    want_k[index], want_v[index] = want[:, heads:heads + kv_heads], want[:, heads + kv_heads:]
    invariant.rotary_store(x, cos[positions], sin[positions], k_store, v_store, index, heads)
    assert torch.equal(x, want) and torch.equal(k_store, want_k) and torch.equal(v_store, want_v)

def _attend(q, k, v, q_counts, k_starts, lengths):
    device = q.device
    starts = torch.tensor([0, *q_counts], device=device).cumsum(0).to(torch.int32)
    return invariant.attention(q, k, v, starts, torch.tensor(k_starts, device=device),
                               torch.tensor(lengths, dtype=torch.int32, device=device), q.shape[-1] ** -0.5)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_a_query_gets_the_same_attention_alone_in_a_prefill_or_a_continuation(device, dtype):
    """Three sequences (5, 70 and 130 tokens; 6 query heads over 2 KV heads) packed as a training forward
    does, against each query's decode step (alone, its keys in a cache slot elsewhere in the store) and a
    continuation of 10 queries over a cached prefix."""
    lengths, heads, kv_heads, dim = [5, 70, 130], 6, 2, 16
    total = sum(lengths)
    q = _randn(total, heads, dim, device=device, dtype=dtype)
    k, v = (_randn(total, kv_heads, dim, device=device, dtype=dtype, seed=s) for s in (1, 2))
    starts = [0, 5, 75]
    packed = _attend(q, k, v, lengths, starts, lengths)
    for first, length in zip(starts, lengths):  # against plain causal attention, per sequence
        rows = slice(first, first + length)
        scores = F.scaled_dot_product_attention(q[rows].transpose(0, 1).float(), k[rows].transpose(0, 1).float(),
                                                v[rows].transpose(0, 1).float(), is_causal=True, enable_gqa=True)
        assert torch.allclose(packed[rows].float(), scores.transpose(0, 1), atol=0.05 if dtype != torch.float32
                              else 1e-5)
    store_k, store_v = torch.cat([k, k]), torch.cat([v, v])  # the cache: keys at rows total + start + j
    for seq, position in ((2, 0), (2, 64), (2, 100), (1, 69), (0, 4)):
        row = starts[seq] + position
        alone = _attend(q[row:row + 1], store_k, store_v, [1], [total + starts[seq]], [position + 1])
        assert torch.equal(alone[0], packed[row]), (seq, position)
    rows = slice(starts[1] + 60, starts[1] + 70)
    continued = _attend(q[rows], store_k, store_v, [10], [total + starts[1]], [70])
    assert torch.equal(continued, packed[rows])
    decode_batch = _attend(q[[4, 75 + 30, 5 + 69]], store_k, store_v, [1, 1, 1],
                           [total, total + 75, total + 5], [5, 31, 70])
    assert torch.equal(decode_batch, packed[[4, 75 + 30, 5 + 69]])
