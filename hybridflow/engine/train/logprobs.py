"""Per-token log-probs and entropy fused with the output projection: full-vocabulary logits never exist.

`token_log_probs(hidden [N, H], weight [V, H], targets [N], temperature)` returns
`log softmax(hidden @ weight.T / T)[target]` and, optionally, the entropy of that softmax; `head_log_probs` also
the divergence from a distillation teacher's top-k (k ids per token, the rest of its mass one more outcome),
and `top_k_log_probs` a teacher's top-k ids and log-probs. Tokens are processed `chunk` at a time: a chunk's
logits `[chunk, V]` are computed, reduced to a few numbers per token (log-sum-exp, the target's log-prob, the
entropy, the top-k divergence) and dropped. The backward recomputes each chunk's logits from the saved hidden
states and turns their gradient into the gradients of `hidden` and `weight` (and `bias`) at once, so at most one
chunk of logits exists at a time in either pass: the head's memory no longer grows with the tokens of a
micro-batch (`[70k, 152k]` fp32 logits are 42 GB).

The per-chunk arithmetic (`_chunk_stats`, `_chunk_grad`) can run through `torch.compile` (`compiled=True`,
the engine's choice on CUDA), which fuses its fp32 passes over the chunk into one or two kernels. In exact
mode (`exact=True`) the forward's logits and log-softmax are the invariant ops the rollout engine samples
with (`hybridflow.engine.invariant`): a token's log-prob is the rollout's, bit for bit (docs/exact.md). No
log-prob's bits depend on the entropy (`_entropy`) or the backward, so `compiled` fuses those in exact mode too.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant

# fp32 elements of one chunk of logits: 2**26 (256 MiB) is 441 tokens at a 151,936-token vocabulary,
# and the whole micro-batch at a toy one. Compiled, a chunk's arithmetic is one or two fused kernels; eager,
# each of its ~6 steps keeps an fp32 copy of the chunk alive, so eager chunks are 4x smaller. Either way
# the head's peak stays under half of one full-vocabulary fp32 logits tensor (2**27 compiled did not:
# docs/training_engine.md).
CHUNK_ELEMENTS = 2**26
REST_FLOOR = 1e-6  # the least probability the mass outside a teacher's top-k counts as (its log is finite)
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


def _entropy(logits: torch.Tensor, lse: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """The entropy `[c]` fp32 of logits `[c, V]` at inverse temperature `inv_temp` from their log-sum-exp: exact
    mode's, beside the invariant log-probs (no log-prob depends on it, so it may be compiled)."""
    z = logits.float() * inv_temp
    return lse - (torch.exp(z - lse[:, None]) * z).sum(-1)


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, inv_t: float,
                soft: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                soft_beta: float = 1.0) -> torch.Tensor:
    """d loss / d logits `[c, V]` in the logits' dtype: d logp_y / dz = onehot(y) - p,
    d H / dz = -p (log p + H) and, for `_top_k_divergence` D over the outcomes o (the ids i_j, then the rest r)
    with d_o = dD / ds_o: dD / dz = scatter((d_j - d_r) s_j) - p sum_j (d_j - d_r) s_j; z = logits / T.
    `soft`: (ids, teacher log-probs, d loss / dD) of a top-k divergence."""
    log_p = logits.float() * inv_t - lse[:, None]
    p = log_p.exp()
    if grad_entropy is None or entropy is None:  # no entropy output, no gradient of it
        g = p * -grad_logp[:, None]
    else:
        g = -p * (grad_logp[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    g = g.scatter_add(-1, targets[:, None], grad_logp[:, None])
    if soft is not None:
        soft_ids, soft_log_q, grad_soft = soft
        log_s, log_t = _outcomes(log_p.gather(-1, soft_ids), soft_log_q)
        d = _divergence_slope(log_s, log_t, soft_beta)
        w = (d[:, :-1] - d[:, -1:]) * log_s[:, :-1].exp()
        g = g - p * (grad_soft * w.sum(-1))[:, None]
        g = g.scatter_add(-1, soft_ids, grad_soft[:, None] * w)
    return (g * inv_t).to(logits.dtype)


def _outcomes(log_s: torch.Tensor, log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) log-probs `[c, k + 1]` of the k ids and of the rest of the vocabulary, from their log-probs
    `[c, k]` at the ids; each rest at least `REST_FLOOR` (its log is finite)."""
    rest_s = (1 - log_s.exp().sum(-1, keepdim=True)).clamp(min=REST_FLOOR).log()
    rest_t = (1 - log_q.exp().sum(-1, keepdim=True)).clamp(min=REST_FLOOR).log()
    return torch.cat([log_s, rest_s], -1), torch.cat([log_q, rest_t], -1)


def _divergence(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized Jensen-Shannon divergence `[c]` over outcomes `[c, n]`: beta 1 KL(student || teacher),
    0 KL(teacher || student), between beta KL(teacher || m) + (1 - beta) KL(student || m) with the mixture
    m = beta teacher + (1 - beta) student."""
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    log_m = _log_mixture(log_s, log_t, beta)
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def _divergence_slope(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """d `_divergence` / d s_o `[c, n]`, up to a constant per row (which the outcomes' probabilities summing to 1
    cancel): log s - log t (reverse), -t / s (forward), (1 - beta)(log s - log m) (between)."""
    if beta == 1:
        return log_s - log_t
    if beta == 0:
        return -(log_t - log_s).exp()
    return (1 - beta) * (log_s - _log_mixture(log_s, log_t, beta))


def _log_mixture(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """log(beta t + (1 - beta) s), for 0 < beta < 1."""
    return torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))


def _top_k_divergence(logits: torch.Tensor, lse: torch.Tensor, soft_ids: torch.Tensor, soft_log_q: torch.Tensor,
                      inv_t: float | torch.Tensor, beta: float) -> torch.Tensor:
    """`_divergence` `[c]` fp32 between a teacher's top-k and the student over k + 1 outcomes: each of the k ids
    and the rest of the vocabulary as one. It is 0 where the student gives each id the teacher's own probability
    (and so, in sum, the rest too). From a chunk's logits `[c, V]` and log-sum-exp: only the `[c, k]` logits at
    the ids are read."""
    log_s, log_t = _outcomes(logits.gather(-1, soft_ids).float() * inv_t - lse[:, None], soft_log_q)
    return _divergence(log_s, log_t, beta)


def _autocast_operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, the operands in the autocast dtype (the head's matmuls run in it, as a plain head's would,
    with autocast itself off inside the chunk loops); else as they are."""
    if not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, with_entropy: bool, chunk: int,
                compiled: bool, exact: bool, soft_ids, soft_log_q, soft_beta: float):
        n = hidden.shape[0]
        inv_t = 1.0 / temperature
        stats = _compiled(_chunk_stats) if compiled else _chunk_stats
        entropy_of = _compiled(_entropy) if compiled else _entropy
        scale = invariant.inverse_temperature(temperature, hidden.device) if exact else None
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        soft = None if soft_ids is None else torch.empty_like(lse)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if scale is not None:  # exact
                logits = invariant.linear(hidden[s:e], weight, bias)
                logp[s:e], lse[s:e] = invariant.token_log_probs(logits, targets[s:e], scale)
                ent = entropy_of(logits, lse[s:e], scale) if with_entropy else None
            else:
                logits = F.linear(hidden[s:e], weight, bias)
                lse[s:e], logp[s:e], ent = stats(logits, targets[s:e], inv_t, with_entropy)
            if entropy is not None and ent is not None:  # with_entropy
                entropy[s:e] = ent
            if soft is not None:
                soft[s:e] = _top_k_divergence(logits, lse[s:e], soft_ids[s:e], soft_log_q[s:e], inv_t, soft_beta)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, soft_ids, soft_log_q)
        ctx.inv_t, ctx.chunk, ctx.compiled, ctx.soft_beta = inv_t, chunk, compiled, soft_beta
        ctx.set_materialize_grads(False)  # an unused output gets None: the cheaper backward
        return logp, entropy, soft

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None, grad_soft=None):
        hidden, weight, bias, targets, lse, entropy, soft_ids, soft_log_q = ctx.saved_tensors
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
            soft = None if grad_soft is None else (soft_ids[s:e], soft_log_q[s:e], grad_soft[s:e])
            g = grad_fn(F.linear(h, weight, bias), targets[s:e], lse[s:e],
                        None if entropy is None else entropy[s:e], grad_logp[s:e],
                        None if grad_entropy is None else grad_entropy[s:e], ctx.inv_t, soft, ctx.soft_beta)
            if need_h:
                torch.mm(g, weight, out=grad_h[s:e])
            if need_w:
                grad_w.addmm_(g.t(), h)
            if need_b:
                grad_b += g.float().sum(0)
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None,
                None, None, None)


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, bias: torch.Tensor | None = None, chunk_size: int | None = None,
                    compiled: bool = False, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden `[N, H]`, weight `[V, H]` (bias `[V]`), targets long `[N]` -> (log-probs `[N]` fp32,
    entropy `[N]` fp32 or None) of `softmax(hidden @ weight.T + bias)` at `temperature`; differentiable
    with respect to hidden, weight and bias. `chunk_size`: tokens per chunk (default `default_chunk(V, compiled)`).
    Under autocast the matmuls run in the autocast dtype, as the plain head's would. `exact`: the forward runs
    the invariant ops, in hidden's dtype (see the module docstring)."""
    logp, entropy, _ = head_log_probs(hidden, weight, targets, temperature, with_entropy, bias, chunk_size, compiled,
                                      exact)
    return logp, entropy


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, bias: torch.Tensor | None = None, chunk_size: int | None = None,
                   compiled: bool = False, exact: bool = False, soft: tuple[torch.Tensor, torch.Tensor] | None = None,
                   soft_beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`token_log_probs`, and with `soft` = (ids long `[N, k]`, a teacher's log-probs `[N, k]` of them: its
    top-k) the divergence between that top-k (the rest of its mass one more outcome) and the same softmax,
    `_top_k_divergence` at `soft_beta` (1: reverse KL, 0: forward KL, between: the generalized JSD): `[N]` fp32
    and differentiable too (None without `soft`)."""
    if (hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]
            or weight.shape[1] != hidden.shape[1]):
        raise ValueError(f"hidden must be [N, H], weight [V, H] and targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    hidden, weight, bias = _autocast_operands(hidden, weight, bias)
    if exact:
        weight, bias = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    if soft is not None and (soft[0].shape != soft[1].shape or soft[0].shape[:1] != targets.shape):
        raise ValueError(f"soft targets must be ids [N, k] and log-probs [N, k] for N = {targets.shape[0]}; got "
                         f"{tuple(soft[0].shape)} and {tuple(soft[1].shape)}")
    soft_ids, soft_log_q = (None, None) if soft is None else (soft[0], soft[1].float())
    chunk = chunk_size or default_chunk(weight.shape[0], compiled)
    with torch.autocast(hidden.device.type, enabled=False):
        logp, entropy, kl = _TokenLogProbs.apply(hidden, weight, bias, targets, float(temperature), bool(with_entropy),
                                                 int(chunk), bool(compiled), bool(exact), soft_ids, soft_log_q,
                                                 float(soft_beta))
    return logp, entropy, kl


@torch.no_grad()
def top_k_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, k: int,
                    temperature: float = 1.0, bias: torch.Tensor | None = None, chunk_size: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs fp32 `[N]` of `targets`, ids long `[N, k]` and log-probs fp32 `[N, k]` of the k likeliest
    tokens, largest first) of `softmax(hidden @ weight.T + bias)` at `temperature` at each of the N positions,
    from one pass over each chunk's logits, without gradients: a distillation teacher's scores (`teacher.topk`)."""
    hidden, weight, bias = _autocast_operands(hidden, weight, bias)
    n, inv_t = hidden.shape[0], 1.0 / temperature
    chunk = chunk_size or default_chunk(weight.shape[0], compiled=False)
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(n, k, dtype=torch.long, device=hidden.device)
    top_logp = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, n, chunk):
            z = F.linear(hidden[s:s + chunk], weight, bias).float() * inv_t
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            logp[s:s + chunk] = (z.gather(-1, targets[s:s + chunk, None]) - lse)[:, 0]
            top, ids[s:s + chunk] = z.topk(k, dim=-1)
            top_logp[s:s + chunk] = top - lse
    return logp, ids, top_logp
