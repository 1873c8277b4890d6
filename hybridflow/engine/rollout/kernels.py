"""Fused elementwise kernels for the decoder and the sampler: Triton on CUDA, plain torch elsewhere.

A decode step of a small model is bound by kernel count, not FLOPs: HF-style RMSNorm is eight kernels,
rotary ten, silu-and-mul two. Each op here is one Triton kernel on CUDA and reproduces the torch
reference's rounding (every bf16 op of the reference is an fp32 compute followed by one rounding), so
the fast path stays close to `transformers`; on CPU (or without Triton) the torch reference runs.

- `add_rms_norm(h, delta, weight, eps)` -> (norm(h + delta) * weight, h + delta)   rows [T, N]; `round_first=False`
  scales the fp32 row before its one rounding (OLMo 2's RMSNorm) instead of rounding it first (Llama's);
  `plus_one=True` scales by (1 + weight) in fp32 (Gemma 3's, whose checkpoints store the scale less one)
- `head_rms_norm_(x, weight, eps)`: the same norm of each head of x [T, heads, D], in place
- `rotary_(x, positions, cos, sin)`: HF rotate-half RoPE in place on x [T, heads, D]
- `silu_mul(gate_up)` -> silu(gate) * up                                          [T, 2I] -> [T, I]
- `sample_plain(logits, inv_temp, seed, greedy)` -> (token, log-prob) per row: one pass over the logits
  for each piece's max and sum of exp, then one uniform per row picks a piece and a token in it by the
  inverse CDF (Philox, counter = row). The temperature and the seed are read from device tensors, so a
  captured CUDA graph can replay it with a new seed each step and any session's temperature.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _rms_norm_torch(h: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True,
                    plus_one: bool = False) -> torch.Tensor:
    x32 = h.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:  # Gemma 3's: (1 + weight) in fp32, one rounding at the end
        return (x32 * (1.0 + weight.float())).to(h.dtype)
    return weight * x32.to(h.dtype) if round_first else (weight * x32).to(h.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, round_first: bool = True, plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HF RMSNorm of (h + delta) (delta None: of h). h, delta [T, N] -> (normed [T, N], h + delta).
    round_first: the normalised row is rounded to h's dtype before the scale (Llama's RMSNorm), else scaled
    in fp32 and rounded once (OLMo 2's). plus_one: the scale is 1 + weight, in fp32, rounded once (Gemma 3's;
    round_first is then unread)."""
    if not use_triton(h) or h.dim() != 2:
        h = h if delta is None else h + delta
        return _rms_norm_torch(h, weight, eps, round_first, plus_one), h
    rows, n = h.shape
    out = torch.empty(rows, n, dtype=h.dtype, device=h.device)
    total = out if delta is None else torch.empty_like(out)
    _add_rms_norm_kernel[(rows,)](h, h if delta is None else delta, weight, out, total, h.stride(0),
                                  0 if delta is None else delta.stride(0), n, eps, n, 0,
                                  HAS_DELTA=delta is not None, ROUND_FIRST=round_first and not plus_one,
                                  PLUS_ONE=plus_one, **_norm_tile(n))
    return out, (h if delta is None else total)


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True,
                   plus_one: bool = False) -> None:
    """HF RMSNorm of each head of x [T, heads, D] (weight [D]) in place: Qwen3's q/k norms (or OLMoE's and
    OLMo 2's over the whole projection: one head of its width; Gemma 3's per head, by 1 + weight), applied inside
    the fused projection's output, so q and k stay where the fused rotary, cache-write and decode kernels read
    them. One launch where the torch reference is eight kernels. round_first, plus_one: see `add_rms_norm`."""
    if not use_triton(x) or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x.copy_(_rms_norm_torch(x, weight, eps, round_first, plus_one))
        return
    tokens, heads, dim = x.shape
    _add_rms_norm_kernel[(tokens, heads)](x, x, weight, x, x, x.stride(0), 0, dim, eps, x.stride(0), dim,
                                          HAS_DELTA=False, ROUND_FIRST=round_first and not plus_one,
                                          PLUS_ONE=plus_one, **_norm_tile(dim))


def _norm_tile(n: int) -> dict[str, int]:
    """The norm kernel's block and warps for rows (or heads) of n elements: one block holds a row."""
    return dict(BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)


def rotary_(x: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place by positions [T]; cos/sin [max_len, D] fp32 tables, or, with
    positions None, already gathered per token ([T, D] in x's dtype: the torch path)."""
    half = x.shape[-1] // 2
    if positions is None or not use_triton(x) or half & (half - 1) or x.stride(-1) != 1 \
            or x.stride(-2) != x.shape[-1]:
        c = (cos if positions is None else cos[positions].to(x.dtype))[:, None]
        s = (sin if positions is None else sin[positions].to(x.dtype))[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * c + torch.cat((-x2, x1), dim=-1) * s)
        return
    tokens, heads, _ = x.shape
    _rotary_kernel[(tokens, heads)](x, positions, cos, sin, x.stride(0), cos.stride(0), HALF=half)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim: [T, 2I] -> [T, I]."""
    rows, width = gate_up.shape
    inter = width // 2
    if not use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), BLOCK=block)
    return out


def sample_plain(logits: torch.Tensor, inv_temp: torch.Tensor, seed: torch.Tensor,
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Untruncated sampling from softmax(logits * inv_temp), or argmax when greedy.

    logits [R, V] (any float dtype, computed in fp32); inv_temp [1] fp32 and seed [1] int64 on the
    device. Returns (tokens [R] int64, logprobs [R] fp32); greedy log-probs are log_softmax(logits)
    (inv_temp is ignored).

    Two kernels. The first splits each row's vocabulary over `sample_splits(V)` programs; each keeps,
    per lane, a running max and sum of exp (one exp per logit) and, when greedy, its best logit, and
    reduces them once at its end. The second, one program per row, merges the pieces into the row's
    log-sum-exp; sampling, it draws one uniform u, finds the piece where u x the total falls in the
    pieces' cumulative sums, and scans that piece's cumulative sum of exp for the token: an exact draw
    by the inverse CDF that reads about 1/splits of the row again. Gumbel-max, the kernel this replaced,
    drew a uniform and took two logs per logit (the two kernels' times: docs/benchmarks.md, "Measurements
    behind choices"). Ties of greedy go to the lowest token id.
    """
    rows, vocab = logits.shape
    splits = sample_splits(vocab)
    width = triton.cdiv(triton.cdiv(vocab, splits), SAMPLE_BLOCK) * SAMPLE_BLOCK
    parts = torch.empty(3, rows, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _sample_part_kernel[(rows, splits)](logits, logits.stride(0), vocab, width, inv_temp, parts, part_idx,
                                        rows * splits, GREEDY=greedy, BLOCK=SAMPLE_BLOCK, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(rows,)](logits, logits.stride(0), vocab, width, inv_temp, seed, parts, part_idx,
                                 rows * splits, splits, tokens, logprobs, GREEDY=greedy,
                                 SPLITS=triton.next_power_of_2(splits), BLOCK=SAMPLE_BLOCK, num_warps=4)
    return tokens, logprobs


SAMPLE_BLOCK = 2048  # logits per loop iteration of a sampling program
SAMPLE_WIDTH = 8192  # logits per program (a 151,936-token vocabulary: 19 programs per row; docs/benchmarks.md)


def sample_splits(vocab: int) -> int:
    """Programs per row of the sampler's first kernel."""
    return max(1, min(64, -(-vocab // SAMPLE_WIDTH)))


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, stride_h, stride_d, n, eps, stride_out,
                             stride_head, HAS_DELTA: tl.constexpr, ROUND_FIRST: tl.constexpr, PLUS_ONE: tl.constexpr,
                             BLOCK: tl.constexpr):
        """One row (program 0), or one head of it (program 1, heads stride_head apart in h and out)."""
        row = tl.program_id(0)
        head = tl.program_id(1) * stride_head
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        h = tl.load(h_ptr + row * stride_h + head + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * n + cols, h, mask=mask)
        x = h.to(tl.float32)
        var = tl.sum(x * x, axis=0) / n
        y = x * tl.rsqrt(var + eps)
        if ROUND_FIRST:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if PLUS_ONE:
            w = 1.0 + w
        tl.store(out_ptr + row * stride_out + head + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope(base, d, cos_ptr, sin_ptr, pos, stride_c, mask, HALF: tl.constexpr):
        """HF rotate-half RoPE of the heads at `base + d` (d: column offsets in [0, 2 * HALF)) by position
        `pos` of the fp32 cos/sin tables (heads where `mask` is false read as zeros) -> the rotated heads in
        base's dtype, rounded as the torch reference is: x * cos + rotate_half(x) * sin, the tables, each
        product and the sum rounded to it. Callers rotating in place need a barrier before storing: a
        column's partner may belong to another thread."""
        dt = base.dtype.element_ty
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(base + (d + HALF) % (2 * HALF), mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * stride_c + d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_c + d).to(dt).to(tl.float32)
        turned = tl.where(d < HALF, -partner, partner)
        return ((x * c).to(dt).to(tl.float32) + (turned * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_c, HALF: tl.constexpr):
        t = tl.program_id(0)
        base = x_ptr + t * stride_t + tl.program_id(1) * 2 * HALF
        d = tl.arange(0, 2 * HALF)
        out = rope(base, d, cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_c, d < 2 * HALF, HALF)
        tl.debug_barrier()  # every thread has read its partner column before any column is overwritten
        tl.store(base + d, out)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dt = out_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=mask)

    @triton.jit
    def _sample_part_kernel(logits_ptr, stride, vocab, width, inv_temp_ptr, parts_ptr, idx_ptr, plane,
                            GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        """One piece of a row: its max and sum of exp of logits * inv_temp (greedy: of the logits) and,
        greedy, its best logit and the lowest token id holding it."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        scale = 1.0 if GREEDY else tl.load(inv_temp_ptr)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        row_ptr = logits_ptr + row * stride
        first = split * width
        for start in range(first, tl.minimum(first + width, vocab), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * scale
            # one exp per logit: the smaller of (running max, x) against the larger
            new_max = tl.maximum(run_max, x)
            e = tl.exp(tl.minimum(run_max, x) - new_max)
            run_sum = tl.where(new_max == float("-inf"), 0.0, tl.where(x > run_max, run_sum * e + 1.0, run_sum + e))
            if GREEDY:  # strict: a lane keeps its lowest id of equal logits
                best_idx = tl.where(x > run_max, cols, best_idx)
            run_max = new_max
        top = tl.max(run_max, axis=0)
        at = row * tl.num_programs(1) + split
        tl.store(parts_ptr + at, top)
        tl.store(parts_ptr + plane + at,
                 tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - top)), axis=0))
        if GREEDY:
            tl.store(idx_ptr + at, tl.min(tl.where(run_max == top, best_idx, 2**31 - 1), axis=0))

    @triton.jit
    def _sample_pick_kernel(logits_ptr, stride, vocab, width, inv_temp_ptr, seed_ptr, parts_ptr, idx_ptr, plane,
                            splits, tok_ptr, lp_ptr, GREEDY: tl.constexpr, SPLITS: tl.constexpr,
                            BLOCK: tl.constexpr):
        """One row: merge its pieces into the log-sum-exp; greedy, take the best piece's token; else draw
        u ~ U[0, 1) and take the first token whose cumulative probability exceeds it."""
        row = tl.program_id(0)
        offs = tl.arange(0, SPLITS)
        mask = offs < splits
        at = row * splits + offs
        piece_max = tl.load(parts_ptr + at, mask=mask, other=float("-inf"))
        piece_sum = tl.load(parts_ptr + plane + at, mask=mask, other=0.0)
        top = tl.max(piece_max, axis=0)
        weight = tl.where(piece_max == float("-inf"), 0.0, piece_sum * tl.exp(piece_max - top))
        total = tl.sum(weight, axis=0)
        log_total = top + tl.log(total)
        row_ptr = logits_ptr + row * stride
        if GREEDY:
            best = tl.argmax(piece_max, axis=0)  # the first of equal maxima: the lowest token id
            token = tl.sum(tl.where(offs == best, tl.load(idx_ptr + at, mask=mask, other=0), 0), axis=0)
            scale = 1.0
        else:
            scale = tl.load(inv_temp_ptr)
            cum = tl.cumsum(weight, axis=0)
            target = tl.rand(tl.load(seed_ptr), row) * total
            # the piece where the target falls; rounding can put it past the last piece with any weight
            last = tl.max(tl.where(weight > 0, offs, 0), axis=0)
            piece = tl.minimum(tl.sum(((cum <= target) & mask).to(tl.int32), axis=0), last)
            below = tl.sum(tl.where(offs < piece, weight, 0.0), axis=0)
            piece_top = tl.sum(tl.where(offs == piece, piece_max, 0.0), axis=0)
            # the remainder in the piece's own scale, exp(x - piece_top), where its sum is piece_sum
            left = (target - below) * tl.exp(top - piece_top)
            token = 2**31 - 1
            fallback = 0  # the piece's last token with any probability, should rounding leave no crossing
            done = 0.0
            first = piece * width
            for start in range(first, tl.minimum(first + width, vocab), BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * scale
                e = tl.exp(x - piece_top)
                crossed = (tl.cumsum(e, axis=0) + done > left) & (e > 0)
                token = tl.minimum(token, tl.min(tl.where(crossed, cols, 2**31 - 1), axis=0))
                fallback = tl.maximum(fallback, tl.max(tl.where(e > 0, cols, 0), axis=0))
                done += tl.sum(e, axis=0)
            token = tl.where(token == 2**31 - 1, fallback, token)
        x_token = tl.load(row_ptr + token).to(tl.float32) * scale
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(lp_ptr + row, x_token - log_total)
