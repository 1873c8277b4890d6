"""The invariant ops' Triton kernels run by Triton's interpreter on CPU tensors: run only by
`test_kernels_interpreted.py`, in a process with TRITON_INTERPRET=1 (the interpreter is chosen when `triton.jit`
decorates a kernel). Each kernel must compute what its PyTorch twin (`torch_ops`) computes, to rounding: this
checks their indexing, masks and launch arguments without a GPU. Bits and batch invariance are the GPU tests'
(`test_invariant_ops.py`): the interpreter's arithmetic is numpy's, not the tensor cores'."""

from __future__ import annotations

import torch

from hybridflow.engine.invariant import torch_ops, triton_attention, triton_gemm, triton_rows


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_linear_with_and_without_bias_at_ragged_shapes():
    x, weight, bias = _randn(37, 72, seed=1), _randn(50, 72, seed=2), _randn(50, seed=3)
    _close(triton_gemm.linear(x, weight, bias), torch_ops.linear(x, weight, bias))
    _close(triton_gemm.linear(x[:5], weight, None), torch_ops.linear(x[:5], weight, None))


def test_row_ops():
    x, delta, weight = _randn(9, 80, seed=1), _randn(9, 80, seed=2), _randn(80, seed=3)
    _close(triton_rows.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    normed, total = triton_rows.add_rms_norm(x, delta, weight, 1e-6)
    _close(total, x + delta)
    _close(normed, torch_ops.rms_norm(x + delta, weight, 1e-6))
    gate_up = _randn(7, 2 * 1100, seed=4)  # past one ELEMENT_BLOCK, a strided row view
    _close(triton_rows.silu_mul(gate_up[:, :1100], gate_up[:, 1100:]),
           torch_ops.silu_mul(gate_up[:, :1100], gate_up[:, 1100:]))
    logits, tokens = _randn(5, 3000, seed=5), torch.tensor([0, 2999, 17, 2048, 5])
    inv_temp = torch.full((1,), 1 / 0.7)
    for got, want in zip(triton_rows.token_log_probs(logits, tokens, inv_temp),
                         torch_ops.token_log_probs(logits, tokens, inv_temp)):
        _close(got, want)


def test_rotary_and_rotary_store():
    heads, kv_heads, dim = 4, 2, 16
    x = _randn(5, heads + 2 * kv_heads, dim, seed=1)
    angles = _randn(5, dim, seed=2)
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.empty_like(x)
    triton_rows.rotary(x, cos, sin, rotated)
    _close(rotated, torch_ops.rotary(x, cos, sin))
    k_store, v_store = torch.zeros(20, kv_heads, dim), torch.zeros(20, kv_heads, dim)
    index = torch.tensor([3, 7, 0, 19, 11])
    fused = x.clone()
    triton_rows.rotary_store(fused, cos, sin, k_store, v_store, index, heads)
    _close(fused[:, :heads + kv_heads], rotated[:, :heads + kv_heads])
    _close(fused[:, heads + kv_heads:], x[:, heads + kv_heads:])
    _close(k_store[index], rotated[:, heads:heads + kv_heads])
    _close(v_store[index], x[:, heads + kv_heads:])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[index] = False
    assert not k_store[untouched].any() and not v_store[untouched].any()


def test_attention_over_packed_sequences_and_a_cache():
    heads, kv_heads, dim = 6, 2, 16
    counts, lengths = [3, 1, 70], [3, 40, 70]  # a prefill, a decode step over a cache, a prefill past a key block
    starts = torch.tensor([0, 3, 4, 74], dtype=torch.int32)
    k_starts = torch.tensor([0, 3, 43])
    q = _randn(74, heads, dim, seed=1)
    k, v = _randn(113, kv_heads, dim, seed=2), _randn(113, kv_heads, dim, seed=3)
    table = triton_attention.tiles(starts, 74, triton_attention.per_tile(heads, kv_heads))
    got = triton_attention.attention(q, k, v, starts, k_starts, torch.tensor(lengths, dtype=torch.int32), 0.25,
                                     table)
    _close(got, torch_ops.attention(q, k, v, starts.tolist(), k_starts.tolist(), lengths, 0.25))
    assert sum(counts) == q.shape[0]
