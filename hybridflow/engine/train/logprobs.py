"""Per-token log-probs and entropy fused with the output projection: full-vocabulary logits never exist.

`token_log_probs(hidden [N, H], weight [V, H], targets [N], temperature)` returns
`log softmax(hidden @ weight.T / T)[target]` and, optionally, the entropy of that softmax. Tokens are
processed `chunk` at a time: a chunk's logits `[chunk, V]` are computed, reduced to three numbers per
token (log-sum-exp, the target's log-prob, the entropy) and dropped. The backward recomputes each
chunk's logits from the saved hidden states and turns their gradient into the gradients of `hidden`
and `weight` (and `bias`) at once, so at most one chunk of logits exists at a time in either pass: the
head's memory no longer grows with the tokens of a micro-batch (`[70k, 152k]` fp32 logits are 42 GB).

The per-chunk arithmetic (`_chunk_stats`, `_chunk_grad`) can run through `torch.compile` (`compiled=True`,
the engine's choice on CUDA), which fuses its fp32 passes over the chunk into one or two kernels. In exact
mode (`exact=True`) the forward's logits and log-softmax are the invariant ops the rollout engine samples
with (`hybridflow.engine.invariant`): a token's log-prob is the rollout's, bit for bit (docs/exact.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant

# fp32 elements of one chunk of logits: 2**26 (256 MiB) is 441 tokens at a 151,936-token vocabulary,
# and the whole micro-batch at a toy one. Compiled, a chunk's arithmetic is one or two fused kernels; eager,
# each of its ~6 steps keeps an fp32 copy of the chunk alive, so eager chunks are 4x smaller. Either way
# the head's peak stays under half of one full-vocabulary fp32 logits tensor (2**27 compiled did not:
# docs/training_engine.md).
CHUNK_ELEMENTS = 2**26
EAGER_CHUNK_ELEMENTS = 2**24


def default_chunk(vocab: int, compiled: bool = True) -> int:
    """Tokens per chunk for a vocabulary of `vocab`, with the chunk arithmetic compiled or eager."""
    return max(1, (CHUNK_ELEMENTS if compiled else EAGER_CHUNK_ELEMENTS) // max(vocab, 1))


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-sum-exp, target log-prob, entropy or None), fp32 `[c]` each, of logits `[c, V]` at 1 / inv_t."""
    z = logits.float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    # H = -sum p log p = lse - sum p z
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return lse, logp, entropy


def _exact_chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_chunk_stats` with the log-sum-exp and the target's log-prob from `invariant.token_log_probs`; the
    entropy (no log-prob depends on it) as usual from them."""
    logp, lse = invariant.token_log_probs(logits, targets, inv_temp)
    entropy = None
    if with_entropy:
        z = logits.float() * inv_temp
        entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return lse, logp, entropy


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """d loss / d logits `[c, V]` in the logits' dtype: d logp_y / dz = onehot(y) - p and
    d H / dz = -p (log p + H), with z = logits / T."""
    log_p = logits.float() * inv_t - lse[:, None]
    p = log_p.exp()
    if grad_entropy is None:
        g = p * -grad_logp[:, None]
    else:
        g = -p * (grad_logp[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    g = g.scatter_add(-1, targets[:, None], grad_logp[:, None])
    return (g * inv_t).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, with_entropy: bool, chunk: int,
                compiled: bool, exact: bool):
        n = hidden.shape[0]
        inv_t = 1.0 / temperature
        stats = _compiled(_chunk_stats) if compiled else _chunk_stats
        scale = invariant.inverse_temperature(temperature, hidden.device) if exact else None
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if exact:
                lse[s:e], logp[s:e], ent = _exact_chunk_stats(invariant.linear(hidden[s:e], weight, bias),
                                                              targets[s:e], scale, with_entropy)
            else:
                lse[s:e], logp[s:e], ent = stats(F.linear(hidden[s:e], weight, bias), targets[s:e], inv_t,
                                                 with_entropy)
            if with_entropy:
                entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.inv_t, ctx.chunk, ctx.compiled = inv_t, chunk, compiled
        ctx.set_materialize_grads(False)  # an unused entropy output gets None: the cheaper backward
        return (logp, entropy) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_fn = _compiled(_chunk_grad) if ctx.compiled else _chunk_grad
        grad_h = torch.empty_like(hidden) if need_h else None
        # a low-precision weight gradient is accumulated by the matmul itself (fp32 inside, one rounding
        # per chunk), as a plain head's single backward matmul would round once
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        n, chunk = hidden.shape[0], ctx.chunk
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            g = grad_fn(F.linear(h, weight, bias), targets[s:e], lse[s:e],
                        None if entropy is None else entropy[s:e], grad_logp[s:e],
                        None if grad_entropy is None else grad_entropy[s:e], ctx.inv_t)
            if need_h:
                torch.mm(g, weight, out=grad_h[s:e])
            if need_w:
                grad_w.addmm_(g.t(), h)
            if need_b:
                grad_b += g.float().sum(0)
        return grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, bias: torch.Tensor | None = None, chunk_size: int | None = None,
                    compiled: bool = False, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden `[N, H]`, weight `[V, H]` (bias `[V]`), targets long `[N]` -> (log-probs `[N]` fp32,
    entropy `[N]` fp32 or None) of `softmax(hidden @ weight.T + bias)` at `temperature`; differentiable
    with respect to hidden, weight and bias. `chunk_size`: tokens per chunk (default `default_chunk(V, compiled)`).
    Under autocast the matmuls run in the autocast dtype, as the plain head's would. `exact`: the forward runs
    the invariant ops, in hidden's dtype (see the module docstring)."""
    if (hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]
            or weight.shape[1] != hidden.shape[1]):
        raise ValueError(f"hidden must be [N, H], weight [V, H] and targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if exact:
        weight, bias = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    chunk = chunk_size or default_chunk(weight.shape[0], compiled)
    with torch.autocast(hidden.device.type, enabled=False):
        out = _TokenLogProbs.apply(hidden, weight, bias, targets, float(temperature), bool(with_entropy),
                                   int(chunk), bool(compiled), bool(exact))
    return (out[0], out[1]) if with_entropy else (out[0], None)
