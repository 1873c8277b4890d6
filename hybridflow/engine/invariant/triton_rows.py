"""The invariant row-wise ops on CUDA: RMSNorm, rotary, silu-and-mul and the token log-prob, in Triton.

One program per row (or per row piece for the elementwise ops), with launch settings that depend only on
the row's width, so a row's result is a function of the row alone, whatever the number of rows, and both
engines run the same compiled kernels. The reductions (a norm's sum of squares, a log-softmax's sum of
exponentials) run in one fixed order per width: a row's vector of partial sums is added block by block
along the row, then reduced once. Each op rounds where Hugging Face's bf16 arithmetic does (every torch op
is an fp32 computation rounded to the dtype), so exact mode stays close to the default engines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENT_BLOCK = 1024  # elements of a row per program of the elementwise kernels
VOCAB_BLOCK = 2048    # logits per step of a log-prob program


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows x [M, n] (contiguous within a row), weight [n] in x's dtype -> [M, n]."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, x, x, weight, out, x.stride(0), 0, n, eps, BLOCK=triton.next_power_of_2(n),
                                  ADD=False, num_warps=4 if n <= 2048 else 8)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
    """(rms_norm(x + delta), x + delta) for rows x, delta [M, n] (contiguous within a row): the sum rounded to
    the dtype as torch's add rounds it, then `rms_norm`'s code on it, in one launch."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out)
    if rows:
        _rms_norm_kernel[(rows,)](x, delta, total, weight, out, x.stride(0), delta.stride(0), n, eps,
                                  BLOCK=triton.next_power_of_2(n), ADD=True, num_warps=4 if n <= 2048 else 8)
    return out, total


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """out = rotate-half RoPE of x [T, heads, D] (heads contiguous, any token stride) by fp32 rows cos/sin
    [T, D]; out may be x (in place)."""
    tokens, heads, dim = x.shape
    if x.stride()[1:] != (dim, 1) or out.stride()[1:] != (dim, 1) or dim & (dim - 1):
        raise ValueError(f"invariant rotary needs a power-of-two head dim and contiguous heads: x {tuple(x.shape)} "
                         f"strides {x.stride()}, out strides {out.stride()}")
    if tokens:
        _rotary_kernel[(tokens, heads)](x, out, cos, sin, x.stride(0), out.stride(0), cos.stride(0), heads, x, x, x, 0,
                                        HALF=dim // 2, Q_HEADS=0, KV_HEADS=0, STORE=False)


def rotary_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                 write_index: torch.Tensor, heads: int) -> None:
    """`rotary` of the q and k heads of x [T, heads + 2 Hkv, D] (q, k and v heads side by side, heads
    contiguous) in place, with each token's rotated k heads and its v heads also written to row
    write_index[t] of k_store / v_store [N, Hkv, D] (contiguous): one launch for what rotary and two cache
    copies do, with the same arithmetic."""
    tokens, all_heads, dim = x.shape
    kv_heads = (all_heads - heads) // 2
    if (x.stride()[1:] != (dim, 1) or dim & (dim - 1) or k_store.shape[1:] != (kv_heads, dim)
            or not k_store.is_contiguous() or v_store.stride() != k_store.stride()):
        raise ValueError(f"invariant rotary_store needs a power-of-two head dim, contiguous heads and stores of "
                         f"[N, {kv_heads}, {dim}]: x {tuple(x.shape)} strides {x.stride()}, k_store "
                         f"{tuple(k_store.shape)} strides {k_store.stride()}, v_store strides {v_store.stride()}")
    if tokens:
        _rotary_kernel[(tokens, all_heads)](x, x, cos, sin, x.stride(0), x.stride(0), cos.stride(0), heads + kv_heads,
                                            k_store, v_store, write_index, k_store.stride(0), HALF=dim // 2,
                                            Q_HEADS=heads, KV_HEADS=kv_heads, STORE=True)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [M, I] (rows contiguous, any row stride) -> [M, I]."""
    rows, inter = gate.shape
    out = torch.empty(rows, inter, dtype=gate.dtype, device=gate.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, ELEMENT_BLOCK))](
            gate, up, out, inter, gate.stride(0), up.stride(0), BLOCK=ELEMENT_BLOCK)
    return out


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor,
                    inv_temp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (rows contiguous), tokens [R], inv_temp [1] fp32 on the device or None ->
    (log-prob of each token, log-sum-exp), fp32 [R] each."""
    rows, vocab = logits.shape
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    if rows:
        _log_prob_kernel[(rows,)](logits, tokens, logits if inv_temp is None else inv_temp, logp, lse,
                                  logits.stride(0), vocab, SCALED=inv_temp is not None, BLOCK=VOCAB_BLOCK,
                                  num_warps=8)
    return logp, lse


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, w_ptr, out_ptr, stride_x, stride_d, n, eps, BLOCK: tl.constexpr,
                     ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # the residual add first, rounded as torch rounds it; the norm below is the same code either way
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * scale).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * y).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_x, stride_out, stride_c, rotated_heads, k_ptr, v_ptr,
                   index_ptr, stride_store, HALF: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                   STORE: tl.constexpr):
    # heads [0, rotated_heads) rotate; with STORE, heads Q_HEADS.. are k heads (rotated, then stored) and heads
    # past rotated_heads v heads (stored as they are)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, 2 * HALF)
    dt = out_ptr.dtype.element_ty
    row = x_ptr + token * stride_x + head * 2 * HALF
    if head < rotated_heads:
        x = tl.load(row + d).to(tl.float32)
        partner = tl.load(row + (d + HALF) % (2 * HALF)).to(tl.float32)
        c = tl.load(cos_ptr + token * stride_c + d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + token * stride_c + d).to(dt).to(tl.float32)
        turned = tl.where(d < HALF, -partner, partner)
        rotated = ((x * c).to(dt).to(tl.float32) + (turned * s).to(dt).to(tl.float32)).to(dt)
        tl.debug_barrier()  # in place: every thread has read its partner column before any column is written
        tl.store(out_ptr + token * stride_out + head * 2 * HALF + d, rotated)
        if STORE:
            if head >= Q_HEADS:
                at = tl.load(index_ptr + token) * stride_store + (head - Q_HEADS) * 2 * HALF
                tl.store(k_ptr + at + d, rotated)
    elif STORE:
        at = tl.load(index_ptr + token) * stride_store + (head - Q_HEADS - KV_HEADS) * 2 * HALF
        tl.store(v_ptr + at + d, tl.load(row + d))


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, inter, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=mask)


@triton.jit
def _log_prob_kernel(logits_ptr, tok_ptr, inv_temp_ptr, logp_ptr, lse_ptr, stride, vocab, SCALED: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    scale = 1.0
    if SCALED:
        scale = tl.load(inv_temp_ptr).to(tl.float32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * scale)
    top_all = tl.max(top, axis=0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * scale
        total += tl.where(cols < vocab, tl.exp(z - top_all), 0.0)
    lse = top_all + tl.log(tl.sum(total, axis=0))
    token = tl.load(tok_ptr + row)
    tl.store(logp_ptr + row, tl.load(base + token).to(tl.float32) * scale - lse)
    tl.store(lse_ptr + row, lse)
