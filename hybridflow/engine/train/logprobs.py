"""Per-token log-probs and entropy from logits, in chunks, without a full-vocabulary fp32 copy.

`token_log_probs(logits [N, V], targets [N], temperature)` returns `log softmax(logits / T)[target]`
and, optionally, the entropy of `softmax(logits / T)`. Rows are processed `chunk_size` at a time in
fp32, so at most `chunk_size x V` fp32 values exist at once, in the forward and in the backward
(which recomputes the softmax per chunk from the saved low-precision logits and the saved log-sum-exp).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 2048


def _scaled_fp32(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = chunk.float()
    return z if temperature == 1.0 else z.mul_(1.0 / temperature)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk: int):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, n, chunk):
            z = _scaled_fp32(logits[s:s + chunk], temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse_c
            if with_entropy:
                p = torch.softmax(z, dim=-1)
                entropy[s:s + chunk] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.set_materialize_grads(False)  # an unused entropy output gets None: the fast backward
        return (logp, entropy) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        """d logp_y / dz = onehot(y) - p; d H / dz = -p (log p + H); z = logits / T."""
        logits, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            g_logp = grad_logp[s:s + chunk, None] / t
            if not need_entropy:
                # fast path: softmax straight from the stored logits (fp32 inside the kernel), then
                # scale in place in the logits' dtype; three passes over the chunk
                x = logits[s:s + chunk]
                p = torch.softmax(x if t == 1.0 else x.float().mul_(1.0 / t), dim=-1)
                g = p.mul_(-g_logp).to(grad.dtype)
            else:
                z = _scaled_fp32(logits[s:s + chunk], t)
                log_p = z - lse[s:s + chunk, None]
                p = log_p.exp()
                g = -p * g_logp - (grad_entropy[s:s + chunk, None] / t) * p * (log_p + entropy[s:s + chunk, None])
                g = g.to(grad.dtype)
            g.scatter_add_(-1, targets[s:s + chunk, None], g_logp.to(g.dtype))
            grad[s:s + chunk] = g
        return grad, None, None, None, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_size: int = DEFAULT_CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits `[N, V]` (any float dtype), targets long `[N]` -> (log-probs `[N]` fp32, entropy `[N]` fp32
    or None), both at `temperature`; differentiable with respect to `logits`."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and targets [N]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    out = _TokenLogProbs.apply(logits, targets, float(temperature), bool(with_entropy), int(chunk_size))
    return (out[0], out[1]) if with_entropy else (out[0], None)
