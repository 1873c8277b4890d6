"""The log-prob head: a causal LM's output projection replaced by one that returns per-token log-probs.

`install_log_prob_head(model)` swaps the model's output embedding (`lm_head`) for a `LogProbHead` that
holds the *same* weight Parameter (tied embeddings stay tied, checkpoint names stay `lm_head.weight`).
Because the head stays inside the root module's forward, FSDP2 gathers its weight with the root's
parameters as it would for the plain head. A forward run inside `head.request(targets, ...)` makes the
head compute `logprobs.token_log_probs` on the positions the model kept (`logits_to_keep`) instead of
logits, so the `[tokens, vocabulary]` logits are never materialised; the results are read from the
request (`HeadRequest.log_probs`, `.entropy`). Outside a request the head is a plain linear layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from hybridflow.engine.train.logprobs import head_log_probs, top_k_log_probs
from hybridflow.engine.train.packing import ModelInputs, to_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class HeadRequest:
    """What the next forward's head computes: `targets` long `[K]`; `index` long `[K]` into the kept
    positions flattened over batch and sequence (None: they are exactly the K wanted, in order); `soft`:
    (ids `[K, k]`, log-probs `[K, k]`) a teacher's top-k per position, whose divergence from the policy at
    `soft_beta` (1 reverse KL, 0 forward KL, between the generalized JSD) goes to `soft_kl`; `topk`: k > 0 also
    returns the k likeliest tokens' ids and log-probs per position (`topk_ids`, `topk_log_probs`)."""

    targets: torch.Tensor
    index: torch.Tensor | None
    temperature: float
    with_entropy: bool
    soft: tuple[torch.Tensor, torch.Tensor] | None = None
    soft_beta: float = 1.0
    topk: int = 0
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    soft_kl: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None

    def outputs(self, unflatten: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the forward computed, each laid out by `unflatten` (`ModelInputs.unflatten`: `[B, R, ...]`):
        `log_probs`, and `entropy`, `topk_kl`, `topk_ids` (long) / `topk_log_probs` where asked."""
        out = {"log_probs": unflatten(self.log_probs)}
        if self.entropy is not None:
            out["entropy"] = unflatten(self.entropy)
        if self.soft_kl is not None:
            out["topk_kl"] = unflatten(self.soft_kl)
        if self.topk_ids is not None and self.topk_log_probs is not None:
            out["topk_ids"] = unflatten(self.topk_ids, torch.long)
            out["topk_log_probs"] = unflatten(self.topk_log_probs)
        return out


def teacher_targets(inputs: ModelInputs, mb: dict[str, torch.Tensor],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's `soft` from micro-batch `mb`'s `teacher_topk_ids` / `teacher_topk_log_probs` `[B, R, k]`: the
    rows of its real response tokens, in the order of `inputs.targets`, on `device`."""
    ids = inputs.per_token(mb["teacher_topk_ids"].cpu()).long()
    log_q = inputs.per_token(mb["teacher_topk_log_probs"].cpu()).float()
    return to_device(ids, device), to_device(log_q, device)


class LogProbHead(torch.nn.Module):
    """`lm_head` that computes chunked log-probs (+ entropy) of requested targets; `compiled` runs the
    per-chunk arithmetic through `torch.compile`."""

    def __init__(self, linear: torch.nn.Module, compiled: bool = False) -> None:
        super().__init__()
        self.weight = cast(torch.nn.Parameter, linear.weight)
        self.bias = getattr(linear, "bias", None)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self.compiled = compiled
        self.exact = False  # the invariant logits and log-softmax (`train.exact.make_exact` sets it)
        self._request: HeadRequest | None = None

    @contextlib.contextmanager
    def request(self, targets: torch.Tensor, index: torch.Tensor | None, temperature: float,
                with_entropy: bool, soft: tuple[torch.Tensor, torch.Tensor] | None = None, soft_beta: float = 1.0,
                topk: int = 0) -> Iterator[HeadRequest]:
        """Within the block, forwards compute log-probs of `targets` (and what `soft` and `topk` ask) into the
        yielded request."""
        req = HeadRequest(targets, index, temperature, with_entropy, soft, soft_beta, topk)
        self._request = req
        try:
            yield req
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self._request
        if req is None:
            return F.linear(hidden, self.weight, self.bias)
        flat = hidden.flatten(0, -2)
        if req.index is not None:
            flat = flat[req.index]
        if req.topk:  # a teacher's scores: the targets' log-probs and the top k from one pass over the logits
            if req.with_entropy or req.soft is not None or self.exact:
                raise ValueError("a top-k request computes log-probs alone: no entropy, soft target or exact mode")
            req.log_probs, req.topk_ids, req.topk_log_probs = top_k_log_probs(flat, self.weight, req.targets,
                                                                              req.topk, req.temperature, self.bias)
        else:
            req.log_probs, req.entropy, req.soft_kl = head_log_probs(flat, self.weight, req.targets,
                                                                     req.temperature, req.with_entropy, self.bias,
                                                                     compiled=self.compiled, exact=self.exact,
                                                                     soft=req.soft, soft_beta=req.soft_beta)
        # the model returns this as its `logits`: the log-probs themselves, so FSDP2's hooks on the
        # root's outputs see a tensor of the head's graph
        return req.log_probs


def install_log_prob_head(model: PreTrainedModel, compiled: bool = False) -> LogProbHead:
    """Replace `model`'s output embedding by a `LogProbHead` over the same weight; returns the head."""
    linear = model.get_output_embeddings()
    if linear is None or not hasattr(linear, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute log-probs with")
    if isinstance(linear, LogProbHead):
        return linear
    head = LogProbHead(linear, compiled)
    model.set_output_embeddings(head)
    return head
