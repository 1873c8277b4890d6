"""The invariant ops in plain PyTorch, for devices without the Triton kernels (CPU): every reduction is a
pairwise tree over a zero-padded power-of-two width, written as elementwise adds.

PyTorch's own CPU reductions and matmuls pick their blocking, vector width and thread split from the
tensor's shape, so a row's result may change with the number of rows beside it; and some of its
elementwise kernels (`silu`, `sigmoid`) run a vector path for the body of a tensor and a scalar one for its
tail, so an element's result may change with its position. Here the only kernels are elementwise ones
whose result depends on the element alone (multiply, add, divide, exp, log, rsqrt, max: checked in
`tests/engine/test_invariant_ops.py`), and `tree_sum` adds element `i` to element `i + width / 2` level by
level. A zero pads the width to a power of two, and zeros beyond the data leave every level's sums as they
were, so a sum does not depend on how far it was padded: a query's keys past its own position, masked to
zero weight, change nothing. Computation is in fp32 (exact products of bf16 inputs), rounded once to the
input dtype where the Triton kernels round. Slow, and meant for tiny models: the CPU tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 elements of one chunk of a linear layer's products [rows, N, K]
_CHUNK_ELEMENTS = 2**24


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order: [..., n] -> [...]."""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    if width != x.shape[-1]:
        x = F.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype."""
    rows, n = x.shape[0], weight.shape[0]
    x32, w32 = x.float(), weight.float()
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(n * weight.shape[1], 1))
    for start in range(0, rows, step):
        out[start:start + step] = tree_sum(x32[start:start + step, None, :] * w32[None])
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows [M, n] -> weight * (x / rms(x)) rounded to x's dtype, then the product rounded again."""
    x32 = x.float()
    scale = torch.rsqrt(tree_sum(x32 * x32) / x.shape[-1] + eps)
    return (weight.float() * (x32 * scale[:, None]).to(x.dtype).float()).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] by fp32 rows cos/sin [T, D], each product and the sum rounded
    to x's dtype (Hugging Face's arithmetic)."""
    c, s = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) rounded to the dtype, times up: [M, I] each -> [M, I]. silu is g / (1 + exp(-g)) from
    elementwise ops: torch's own `silu` is not position-invariant on a CPU."""
    g = gate.float()
    act = (g / (1.0 + torch.exp(-g))).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor,
                    inv_temp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (log softmax(logits * inv_temp)[token], log-sum-exp), fp32 [R] each."""
    z = logits.float()
    if inv_temp is not None:
        z = z * inv_temp
    top = z.amax(dim=-1)
    lse = top + torch.log(tree_sum(torch.exp(z - top[:, None])))
    return z.gather(-1, tokens[:, None].long())[:, 0] - lse, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: list[int], k_starts: list[int],
              lengths: list[int], scale: float) -> torch.Tensor:
    """See `ops.attention`; the starts and lengths as Python lists. Each query's softmax over its keys
    0..position and the weighted sum of their values are tree sums over the key index."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for s, length in enumerate(lengths):
        first, last = q_starts[s], q_starts[s + 1]
        if last == first:
            continue
        queries = q[first:last].float()                                    # [Q, H, D]
        keys = k[k_starts[s]:k_starts[s] + length].float().repeat_interleave(group, dim=1).transpose(0, 1)
        values = v[k_starts[s]:k_starts[s] + length].float().repeat_interleave(group, dim=1).permute(1, 2, 0)
        scores = tree_sum(queries[:, :, None, :] * keys[None]) * scale     # [Q, H, L]
        position = torch.arange(length - (last - first), length, device=q.device)
        seen = torch.arange(length, device=q.device)[None, :] <= position[:, None]
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        summed = tree_sum(weights[:, :, None, :] * values[None])          # [Q, H, D]
        out[first:last] = (summed / tree_sum(weights)[..., None]).to(q.dtype)
    return out
