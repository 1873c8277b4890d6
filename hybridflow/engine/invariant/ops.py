"""The invariant ops both engines call in exact mode, each dispatched to its Triton kernel on CUDA and to
its PyTorch twin elsewhere (`torch_ops`). Forward only: the training engine wraps them for autograd
(`hybridflow.engine.train.exact`).

Contract of every op: an output row (a token's projection, norm, rotation, activation or log-prob; a
query's attention) is a function of that row's inputs alone (and, for attention, of its sequence's keys
0..its position), computed by the same kernel with the same launch settings whatever the number of rows,
their order, or how a batch was split. So a token gets the same bits in the rollout's prefill, in a cached
decode step, and in the trainer's packed forward, in bf16 as in fp32. Callers pass every operand in the
compute dtype (a weight cast from fp32 master weights is rounded once, the same way, on both sides).
"""

from __future__ import annotations

import torch

from hybridflow.engine.invariant import torch_ops


def _triton(x: torch.Tensor) -> bool:
    """Whether `x`'s op runs the Triton kernel (CUDA), else the PyTorch twin."""
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise RuntimeError("rollout.exact on CUDA needs Triton (its batch-invariant kernels)") from err
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], all in x's dtype."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"invariant linear takes operands in one dtype: x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else bias.dtype}")
    flat = x.reshape(-1, x.shape[-1])
    if _triton(x):
        from hybridflow.engine.invariant.triton_gemm import linear as kernel

        out = kernel(flat if flat.stride(1) == 1 else flat.contiguous(), weight.contiguous(), bias)
    else:
        out = torch_ops.linear(flat, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm over the last dim: normalise in fp32, round to x's dtype, times the weight
    (in x's dtype), rounded. x [..., n] -> [..., n]."""
    flat = x.reshape(-1, x.shape[-1])
    weight = weight.to(x.dtype)
    if _triton(x):
        from hybridflow.engine.invariant.triton_rows import rms_norm as kernel

        out = kernel(flat if flat.stride(1) == 1 else flat.contiguous(), weight.contiguous(), eps)
    else:
        out = torch_ops.rms_norm(flat, weight, eps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta), x + delta), x and delta [M, n] in one dtype: the bits of the add and `rms_norm` apart
    (on CUDA in one kernel, where `add_rms_norm_holds` says its bits are those)."""
    if _triton(x):
        from hybridflow.engine.invariant.triton_rows import add_rms_norm as kernel

        out, total = kernel(x if x.stride(1) == 1 else x.contiguous(), delta if delta.stride(1) == 1
                            else delta.contiguous(), weight.to(x.dtype).contiguous(), eps)
        return out.view(x.shape), total.view(x.shape)
    total = x + delta
    return rms_norm(total, weight, eps), total


def add_rms_norm_holds(dtype: torch.dtype, n: int, device: torch.device) -> bool:
    """Whether `add_rms_norm` on `device` gives, for rows of width n in `dtype`, the bits of the add and then
    `rms_norm` (which the trainer runs: Hugging Face's residual add, then its norm). Checked on 64 random rows:
    the fused kernel sums the squares in the same order only if Triton lays both kernels out alike."""
    generator = torch.Generator().manual_seed(0)
    x, delta, weight = (torch.randn(rows, n, generator=generator).to(device, dtype) for rows in (64, 64, 1))
    fused, total = add_rms_norm(x, delta, weight[0], 1e-6)
    return torch.equal(total, x + delta) and torch.equal(fused, rms_norm(x + delta, weight[0], 1e-6))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] by each token's fp32 rows cos/sin [T, D] (`rope_table` rows
    gathered by position); into `out` (x itself rotates in place), else a new tensor."""
    if _triton(x):
        from hybridflow.engine.invariant.triton_rows import rotary as kernel

        target = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        kernel(x, cos, sin, target)
        return target
    rotated = torch_ops.rotary(x, cos, sin)
    return rotated if out is None else out.copy_(rotated)


def rotary_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                 write_index: torch.Tensor, heads: int) -> None:
    """x [T, heads + 2 Hkv, D]: each token's q, k and v heads side by side (a fused projection). Rotates the q
    and k heads in place as `rotary` does and writes each token's k (rotated) and v heads to row
    write_index[t] ([T] int64) of the key and value stores [N, Hkv, D]: on CUDA in one kernel."""
    kv_heads = (x.shape[1] - heads) // 2
    if _triton(x):
        from hybridflow.engine.invariant.triton_rows import rotary_store as kernel

        kernel(x, cos, sin, k_store, v_store, write_index, heads)
        return
    qk = x[:, :heads + kv_heads]
    rotary(qk, cos, sin, out=qk)
    k_store.index_copy_(0, write_index, x[:, heads:heads + kv_heads])
    v_store.index_copy_(0, write_index, x[:, heads + kv_heads:])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the activation rounded to the dtype before the product: [M, I] each -> [M, I]."""
    if _triton(gate):
        from hybridflow.engine.invariant.triton_rows import silu_mul as kernel

        return kernel(gate, up)
    return torch_ops.silu_mul(gate, up)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor,
                    inv_temp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V], tokens [R] -> (log softmax(logits * inv_temp)[token], log-sum-exp), fp32 [R] each.
    inv_temp: [1] fp32 on the logits' device (`inverse_temperature`), or None for 1."""
    if _triton(logits):
        from hybridflow.engine.invariant.triton_rows import token_log_probs as kernel

        return kernel(logits if logits.stride(1) == 1 else logits.contiguous(), tokens, inv_temp)
    return torch_ops.token_log_probs(logits, tokens, inv_temp)


def inverse_temperature(temperature: float, device: torch.device) -> torch.Tensor:
    """[1] fp32 holding 1 / temperature, rounded once from the Python float, as the rollout's decode
    buffers hold it (`RunningBatch.reset`), so both engines scale the logits by the same number."""
    return torch.full((1,), 1.0 / temperature, dtype=torch.float32, device=device)


def attention_table(q_starts: torch.Tensor, queries: int, heads: int, kv_heads: int) -> torch.Tensor | None:
    """The work table `attention` takes for queries packed by q_starts [S + 1] int32 (`queries` of them):
    built once per forward and shared by its layers; None where the PyTorch twin runs."""
    return _triton_table(q_starts, queries, heads, kv_heads) if _triton(q_starts) else None


def _triton_table(q_starts: torch.Tensor, queries: int, heads: int, kv_heads: int) -> torch.Tensor:
    from hybridflow.engine.invariant import triton_attention

    return triton_attention.tiles(q_starts, queries, triton_attention.per_tile(heads, kv_heads))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: torch.Tensor, k_starts: torch.Tensor,
              lengths: torch.Tensor, scale: float, table: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' keys.

    q [T, H, D]: sequence s's queries are rows q_starts[s]..q_starts[s + 1] ([S + 1] int32), the last ones of
    the sequence: query i of n sits at position lengths[s] - n + i. k/v [N, Hkv, D]: the key store, sequence
    s's key j at row k_starts[s] + j ([S] int64); lengths [S] int32, each sequence's keys (its context).
    Query heads share KV heads in groups of H / Hkv. Returns [T, H, D] in q's dtype. `table`: from
    `attention_table` (made here when None).
    """
    if _triton(q):
        from hybridflow.engine.invariant import triton_attention

        if table is None:
            table = _triton_table(q_starts, q.shape[0], q.shape[1], k.shape[1])
        return triton_attention.attention(q, k, v, q_starts, k_starts, lengths, scale, table)
    return torch_ops.attention(q, k, v, q_starts.tolist(), k_starts.tolist(), lengths.tolist(), scale)


def rope_table(config, length: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, D] fp32 of the config's rotary embedding (rope_theta, llama3 and other
    rope_scaling types: Hugging Face's inverse frequencies and attention scaling) at positions 0..length-1.
    Computed on the CPU with elementwise ops, so a position's row is the same on every device and for any
    length; both engines gather their rows from it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(config)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * rope.inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * rope.attention_scaling).to(device), (angles.sin() * rope.attention_scaling).to(device)
