"""Per-token log-probs and entropy from logits, in chunks, without a full-vocabulary fp32 copy.

`token_log_probs(logits [N, V], targets [N], temperature)` returns `log softmax(logits / T)[target]`
and, optionally, the entropy of `softmax(logits / T)`. Rows are processed `chunk_size` at a time in
fp32, so at most `chunk_size x V` fp32 values exist at once, in the forward and in the backward
(which recomputes the softmax per chunk from the saved low-precision logits and the saved log-sum-exp).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 2048


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk: int):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, n, chunk):
            z = logits[s:s + chunk].float() / temperature
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse_c
            if with_entropy:
                p = torch.exp(z - lse_c[:, None])
                entropy[s:s + chunk] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return (logp, entropy) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            z = logits[s:s + chunk].float() / t
            p = torch.exp(z - lse[s:s + chunk, None])
            g_logp = grad_logp[s:s + chunk, None] if grad_logp is not None else None
            g = -p * g_logp if g_logp is not None else torch.zeros_like(z)
            if g_logp is not None:
                g.scatter_add_(-1, targets[s:s + chunk, None], g_logp)
            if ctx.with_entropy and grad_entropy is not None:
                log_p = z - lse[s:s + chunk, None]
                g -= grad_entropy[s:s + chunk, None] * p * (log_p + entropy[s:s + chunk, None])
            grad[s:s + chunk] = (g / t).to(grad.dtype)
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
