"""Prompt log-probs: each prompt token's log-probability given the tokens before it, under the engine's weights.

What a Tinker `compute_logprobs` asks for (a sample request with `prompt_logprobs`, and `topk_prompt_logprobs`): the
reference model of DPO, the teacher of on-policy distillation, a KL metric against the base model.
`prompt_logprobs(engine, prompts, topk)` gives, per prompt of n tokens, `PromptLogprobs` over its n - 1 scored
positions (token i + 1 given tokens 0..i): log_softmax of the raw logits (temperature 1, as the trainer's forward
computes them) in fp32, and with `topk` the k most likely tokens at each position.

The fast engine packs prompts into one forward as its prefill does (a new prompt attends over its own tokens). Their
K/V go to the scratch slot, which holds nothing between a session's steps (`KVCache.scratch_slot`), in consecutive
positions, so a forward takes at most `max_model_len` tokens and no more than a prefill's `max_prefill_tokens`. The
head then runs over at most `LOGIT_BYTES` of fp32 logits at a time: a 32k-token prompt's logits at a 152k
vocabulary would be 20 GB at once. Other engines (`transformers` behind `HFRolloutEngine`) run one prompt per forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.engine import RolloutEngine

LOGIT_BYTES = 1 << 28


class PromptLogprobs(NamedTuple):
    """One prompt's scores on the CPU: logprobs [n - 1] fp32; with top-k, top_ids [n - 1, k] int64 and
    top_logprobs [n - 1, k] fp32, most likely first (else None)."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@torch.inference_mode()
def prompt_logprobs(engine, prompts: list[list[int]], topk: int = 0) -> list[PromptLogprobs]:
    """`PromptLogprobs` of each prompt (at most the engine's `max_model_len` tokens; one token has none to score)."""
    if topk < 0:
        raise ValueError(f"topk={topk} must be >= 0")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: score prompts of at least one token")
    long = [i for i, p in enumerate(prompts) if len(p) > engine.max_model_len]
    if long:
        raise ValueError(f"prompt {long[0]} has {len(prompts[long[0]])} tokens, more than the engine's context of "
                         f"max_model_len={engine.max_model_len}")
    if not isinstance(engine, RolloutEngine):
        return [_hf_prompt(engine, prompt, topk) for prompt in prompts]
    if engine.model.exact:
        raise ValueError("prompt log-probs are not served by an exact-mode engine (rollout.exact): its forwards attend "
                         "over each row's own cache slot; score with the trainer's forward instead")
    budget = min(engine.max_model_len, engine.max_prefill_tokens)
    out: list[PromptLogprobs] = []
    chunk: list[list[int]] = []
    tokens = 0  # in `chunk`
    for prompt in prompts:
        if chunk and tokens + len(prompt) > budget:
            out += _fast_chunk(engine, chunk, topk)
            chunk, tokens = [], 0
        chunk.append(prompt)
        tokens += len(prompt)
    return out + _fast_chunk(engine, chunk, topk) if chunk else out


def _fast_chunk(engine: RolloutEngine, prompts: list[list[int]], topk: int) -> list[PromptLogprobs]:
    """One packed forward over `prompts`, their K/V written to consecutive positions of the scratch slot."""
    dev, lens = engine.device, [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    cu = torch.tensor([0] + lens).cumsum(0)
    write = engine.kv.scratch_slot * engine.max_model_len + torch.arange(len(ids), device=dev)
    meta = AttnMeta(write_index=write, cu_seqlens=cu.to(dev, torch.int32), seqlens=lens, max_seqlen=max(lens))
    h, delta = engine.model.hidden(ids, positions, meta, engine.kv)
    # each prompt's last token predicts nothing of the prompt: the rows scored are the others, against the next token
    scored = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(cu[:-1].tolist(), lens)]).to(dev)
    rows = max(1, LOGIT_BYTES // (4 * engine.config.vocab_size))
    parts = [_scores(engine.model.logits(h[r], None if delta is None else delta[r]).float(), ids[r + 1], topk)
             for r in scored.split(rows)]
    sizes = [n - 1 for n in lens]
    logprobs = torch.cat([lp for lp, _, _ in parts]).cpu().split(sizes)
    if not topk:
        return [PromptLogprobs(lp, None, None) for lp in logprobs]
    top_ids = torch.cat([t for _, t, _ in parts if t is not None]).cpu().split(sizes)
    top_lps = torch.cat([t for _, _, t in parts if t is not None]).cpu().split(sizes)
    return [PromptLogprobs(*scores) for scores in zip(logprobs, top_ids, top_lps)]


def _hf_prompt(engine, prompt: list[int], topk: int) -> PromptLogprobs:
    """One prompt through the transformers model of `HFRolloutEngine`."""
    ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
    logits = engine.model(input_ids=ids).logits[0, :-1].float()
    lp, top_ids, top_lps = _scores(logits, ids[0, 1:], topk)
    return PromptLogprobs(lp.cpu(), None if top_ids is None else top_ids.cpu(),
                          None if top_lps is None else top_lps.cpu())


def _scores(logits: torch.Tensor, targets: torch.Tensor,
            topk: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fp32 logits [R, V] and the tokens that follow [R] -> (their log-probs [R], top-k ids and log-probs or None)."""
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, targets[:, None]).squeeze(1)
    if not topk:
        return picked, None, None
    top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    return picked, top.indices, top.values
