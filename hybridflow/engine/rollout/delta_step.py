"""The Gated DeltaNet's decode step over the rollout's state cache: each row steps its slot's recurrent state in place.

A decode step of a hybrid model (Qwen3.5, Qwen3-Next) moves more bytes of recurrent state than of weights: one row's
state is HV x K x V fp32 (1 MiB a linear layer at Qwen3.5-0.8B's 16 heads of 128 x 128), 256 MiB a layer at 256
rows. flash-linear-attention's recurrent step takes its states by row, so stepping slots through it meant gathering
each row's state, zeroing a fresh row's, stepping, selecting a finished row's old state back and scattering: about
thirteen passes over those bytes where the step needs two (one read, one write). On one H200 (Qwen3.5-0.8B's shape,
256 rows, `bench/h200.sh families`) that path's decode step took 31 ms against a 2.9 ms roofline.

`step_(q, k, v, g, beta, states, slots, fresh, live)` -> o [B, HV, V] in v's dtype, and `states[slots]` stepped:
- q, k [B, H, K], v [B, HV, V]: a row's token, each key head serving HV / H consecutive value heads; q and k are
  L2-normalised here (eps 1e-6) and q scaled by K^-0.5, as `use_qk_l2norm_in_kernel` does;
- g [B, HV] the log decay (fp32), beta [B, HV] (after its sigmoid);
- states [S, HV, K, V] fp32, the cache's pool for one layer; slots [B] int64 each row's slot;
- fresh [B] bool: the row starts from zero states (its first token, a one-token prompt over the cache);
- live [B] bool: the row's new state is kept (a finished row's slot keeps the state of its last token).

On CUDA one Triton program per (row, value head, block of V columns) loads the slot's state block once, decays it,
takes the delta rule's update and the output, and stores the block back only for a live row. Elsewhere (CPU) the same
maths runs in torch through transformers' recurrent reference (`linear_attention.delta_rule_step`) on the gathered
states. The order of operations is the reference's (decay, kv memory, delta, update, output), in fp32.
"""

from __future__ import annotations

import torch

from hybridflow.engine import linear_attention as la
from hybridflow.engine.rollout import kernels
from hybridflow.engine.rollout.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _step_kernel(q, k, v, g, beta, states, slots, fresh, live, out,
                     q_row, q_head, k_row, k_head, v_row, v_head, gb_row, o_row, o_head, s_slot, s_head, s_key,
                     group, scale, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        row, hv, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        h = hv // group
        ks = tl.arange(0, BK)
        vs = block * BV + tl.arange(0, BV)
        k_in, v_in = ks < K, vs < V
        qv = tl.load(q + row * q_row + h * q_head + ks, mask=k_in, other=0.0).to(tl.float32)
        kv = tl.load(k + row * k_row + h * k_head + ks, mask=k_in, other=0.0).to(tl.float32)
        qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
        kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        vv = tl.load(v + row * v_row + hv * v_head + vs, mask=v_in, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + row * gb_row + hv).to(tl.float32))
        b = tl.load(beta + row * gb_row + hv).to(tl.float32)
        block_in = k_in[:, None] & v_in[None, :]
        at = states + tl.load(slots + row) * s_slot + hv * s_head + ks[:, None] * s_key + vs[None, :]
        s = tl.load(at, mask=block_in, other=0.0)
        s = tl.where(tl.load(fresh + row) != 0, 0.0, s)  # a select, not a product: a slot's old values never leak
        s = s * decay
        delta = (vv - tl.sum(s * kv[:, None], axis=0)) * b
        s = s + kv[:, None] * delta[None, :]
        o = tl.sum(s * qv[:, None], axis=0)
        tl.store(out + row * o_row + hv * o_head + vs, o.to(out.dtype.element_ty), mask=v_in)
        if tl.load(live + row) != 0:
            tl.store(at, s, mask=block_in)


def step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """One token per row from and into its slot's recurrent state (see the module's docstring) -> o [B, HV, V]."""
    if not kernels.use_triton(q):
        before = states[slots].masked_fill(fresh[:, None, None, None], 0)
        o, after = la.delta_rule_step(q, k, v, g, beta, before)
        states[slots] = torch.where(live[:, None, None, None], after, states[slots])
        return o
    rows, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    assert states.stride(3) == 1 and q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride() == beta.stride()
    out = torch.empty(rows, value_heads, value_dim, dtype=v.dtype, device=v.device)
    block = min(32, triton.next_power_of_2(value_dim))
    _step_kernel[(rows, value_heads, triton.cdiv(value_dim, block))](
        q, k, v, g, beta, states, slots, fresh, live, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1), states.stride(0), states.stride(1),
        states.stride(2), value_heads // heads, key_dim ** -0.5, K=key_dim, V=value_dim,
        BK=triton.next_power_of_2(key_dim), BV=block, num_warps=4)
    return out
