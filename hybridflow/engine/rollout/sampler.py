"""The sampler: fp32 logits -> (token, log-prob) per row, with temperature, top-k, top-p and a seed.

Off the fused path, sampling uses the Gumbel-max trick: `argmax(logp + g)` with `g = -log(E)`,
`E = -log(U) ~ Exponential(1)`, `U` uniform from the caller's `torch.Generator`, which is an exact sample
from `softmax(logp)`. The log-prob of the sampled token comes from the same logits (no second forward):
it is the token's log-probability under the distribution actually sampled from, i.e. after temperature
and after top-k / top-p truncation and renormalisation. Without truncation this equals
`log_softmax(logits / T)`, which is what verl-style trainers recompute. Greedy rows (temperature 0) take
the argmax and report `log_softmax(logits)`. On CUDA without truncation `kernels.sample_plain` samples
the same distribution by the inverse CDF, with one uniform per row instead of one per logit. In exact
mode (`rollout.exact`) the token is drawn the same way and its log-prob is the training engine's:
`invariant.token_log_probs` of the logits at the temperature.
"""

from __future__ import annotations

import torch

from hybridflow.engine import invariant
from hybridflow.engine.rollout.kernels import sample_plain, use_triton
from hybridflow.engine.rollout.types import SamplingParams


def _truncate(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (in place). x: [R, V] fp32."""
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x.masked_fill_(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p; the most
        # likely token is always kept.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        x.masked_fill_(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf"))
    return x


def fused(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether `sample` takes the fused kernels (CUDA with Triton, no top-k / top-p)."""
    return use_triton(logits) and params.top_k == -1 and params.top_p == 1.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           seed: torch.Tensor | None = None, inv_temp: torch.Tensor | None = None,
           exact: bool = False, never: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    logits: [R, V], any float dtype (converted to fp32; may be modified in place when already fp32).
    Returns (tokens [R] int64, logprobs [R] fp32). When `fused`, `kernels.sample_plain` (the inverse
    CDF, one Philox uniform per row) draws from the same distribution, seeded by `seed` ([1] int64 on
    the device; None: drawn from `generator`) at the inverse temperature `inv_temp` ([1] fp32 on the
    device; None: from params). `exact`: the log-probs come from `invariant.token_log_probs` (at temperature
    1 when greedy), the arithmetic the training engine's log-prob head runs. `never`: [K] token ids that are never
    drawn (a vision-language model's image placeholders); the log-probs stay the policy's over every token
    (of the unmasked logits, at the sampling temperature within top-k / top-p), what the trainer computes for the
    drawn ones.
    """
    if never is not None and not exact and not fused(logits, params):
        return _draw_except(logits, params, generator, never)
    # the torch path scales fp32 logits in place; the exact log-probs read them afterwards
    source = logits.clone() if exact and logits.dtype == torch.float32 else logits
    if never is not None:  # out of place: the log-probs below read the logits as they were
        source = source.index_fill(-1, never, float("-inf"))
    tokens, logprobs = _draw(source, params, generator, seed, inv_temp)
    if never is not None and not exact:  # fused, so no truncation: log_softmax at the temperature
        x = logits.float()
        if not params.greedy:  # the device's inverse temperature where given, as the draw's (a CUDA graph replays it)
            x = x * (inv_temp if inv_temp is not None else 1.0 / params.temperature)
        logprobs = x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    if exact:
        if params.greedy:
            inv_temp = None
        elif inv_temp is None:
            inv_temp = invariant.inverse_temperature(params.temperature, logits.device)
        logprobs = invariant.token_log_probs(logits, tokens, inv_temp)[0]
    return tokens, logprobs


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
          seed: torch.Tensor | None, inv_temp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if fused(logits, params):
        if seed is None:
            seed = torch.randint(2**62, (1,), generator=generator, device=logits.device)
        if inv_temp is None:
            inv_temp = torch.full((1,), 1.0 / max(params.temperature, 1e-6), dtype=torch.float32,
                                  device=logits.device)
        return sample_plain(logits, inv_temp, seed, params.greedy)
    x = logits.float()
    if params.greedy:
        tokens = x.argmax(dim=-1)
        logprobs = x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
        return tokens, logprobs
    if params.temperature != 1.0:
        x = x.div_(params.temperature)
    x = _truncate(x, params.top_k, params.top_p)
    lse = torch.logsumexp(x, dim=-1)
    tokens = _gumbel_argmax(x, generator)
    logprobs = x.gather(-1, tokens[:, None])[:, 0] - lse
    return tokens, logprobs


def _draw_except(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 never: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch sampler's draw with the `never` ids left out, the log-prob the policy's over every token: the
    normaliser is taken before the ids are masked, and the drawn token is never one of them, so its logit is the
    same masked or not. One pass over the logits, where a masked draw and the unmasked log-probs took two."""
    x = logits.float()
    if not params.greedy:
        x = _truncate(x.div_(params.temperature), params.top_k, params.top_p)
    lse = torch.logsumexp(x, dim=-1)
    x = x.index_fill_(-1, never, float("-inf"))
    tokens = x.argmax(dim=-1) if params.greedy else _gumbel_argmax(x, generator)
    return tokens, x.gather(-1, tokens[:, None])[:, 0] - lse


def _gumbel_argmax(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """argmax(x + Gumbel noise) per row of x [R, V] fp32: a draw from softmax(x). The noise buffer is reused."""
    # E = -log(U) with U uniform is Exponential(1); drawn this way because `exponential_` costs several
    # times a uniform draw on a CPU (docs/benchmarks.md). E == 0 would give a +inf Gumbel and a NaN on
    # a -inf (truncated) logit; clamp it away.
    noise = torch.rand(x.shape, generator=generator, device=x.device).log_().neg_().clamp_min_(1e-30).log_()
    return torch.sub(x, noise, out=noise).argmax(dim=-1)
