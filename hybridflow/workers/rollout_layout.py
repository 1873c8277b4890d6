"""The rollout's batch layout (docs/architecture.md): a prompt batch's token lists, images and dataset fields for the
engine, and the engine's completions or multi-turn trajectories back into the RL batch (responses, masks, log-probs,
the policy versions and the MoE routes that sampled them; the endpoint's own prompts and images; the agents'
per-row fields). `RolloutReplica` (`rollout_replica.py`) calls them around its engine."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.agents.loop.trajectory import STAT_FIELDS
from hybridflow.batch import Batch
from hybridflow.data.image_prompts import VISION_KEYS, VisionInputs
from hybridflow.data.loader import PROMPT_FIELDS


def prompt_token_lists(prompts: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded prompts `[B, P]` -> the real token ids of each row."""
    if prompts.shape != attention_mask.shape:
        raise ValueError(f"generate needs `attention_mask` of the prompt, shape {tuple(prompts.shape)}; "
                         f"got {tuple(attention_mask.shape)}")
    return [row[mask.bool()].tolist() for row, mask in zip(prompts, attention_mask)]


def batch_vision(batch: Batch) -> list[VisionInputs | None]:
    """Each prompt row's images (`VisionInputs.pad_rows`' tensors); a vision model's batch without them is refused."""
    if VISION_KEYS[0] not in batch:
        raise ValueError("the rollout serves a vision-language model, but the prompt batch carries no images "
                         "(pixel_values); set data.image_key to the column holding them")
    return VisionInputs.unpad_rows(batch["pixel_values"], batch["image_grid_thw"])


def prompt_rows(batch: Batch) -> list[dict[str, Any]]:
    """Each prompt row's dataset fields (those of `PROMPT_FIELDS` and `uid` the batch has), as dicts."""
    keys = [k for k in ("uid", *PROMPT_FIELDS) if k in batch]
    return [{k: batch[k][i] for k in keys} for i in range(len(batch))]


def completions_to_batch(batch: Batch, outs: list, n: int, response_width: int, pad_id: int,
                         prompt_width: int = 0, version: int | None = None) -> Batch:
    """The input rows repeated `n` times (interleaved) plus the sampled responses, right-padded to
    `response_width`: responses, input_ids, attention_mask, position_ids, response_mask, rollout_log_probs,
    and, when the engine recorded routes, rollout_routes (`routes_to_batch`), and given the engine's `version`,
    rollout_versions (int32: the policy version that sampled each token; a multi-turn trajectory, generated in one
    call, is all of `version`).

    outs[i][j] has token_ids, logprobs and finish_reason: a `Completion`, or a multi-turn `Trajectory`,
    whose `response_mask` (1 on model tokens, 0 on environment tokens) becomes the row's response_mask
    while attention_mask covers all its tokens; a trajectory with its own `prompt_ids` (the endpoint's)
    replaces its row's prompt, the prompts then left-padded to at least `prompt_width` (the same on every
    rank, so the ranks' rows concatenate), and its images (`vision`, a vision-language model's) the row's."""
    rows = len(outs) * n
    responses = torch.full((rows, response_width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(rows, response_width, dtype=torch.float32)
    response_mask = torch.zeros(rows, response_width, dtype=torch.float32)
    real = torch.zeros(rows, response_width, dtype=torch.long)
    versions = torch.zeros(rows, response_width, dtype=torch.int32)
    finished = []
    for i, samples in enumerate(outs):
        for j, c in enumerate(samples):
            r, k = i * n + j, min(len(c.token_ids), response_width)
            responses[r, :k] = torch.tensor(c.token_ids[:k], dtype=torch.long)
            logprobs[r, :k] = torch.tensor(c.logprobs[:k], dtype=torch.float32)
            real[r, :k] = 1
            mask = getattr(c, "response_mask", None)
            response_mask[r, :k] = 1.0 if mask is None else torch.tensor(mask[:k], dtype=torch.float32)
            if version is not None:
                versions[r, :k] = torch.tensor(c.versions[:k], dtype=torch.int32) if hasattr(c, "versions") \
                    else version
            finished.append(c.finish_reason)
    out = batch.repeat_interleave(n)
    own = [getattr(c, "prompt_ids", None) for samples in outs for c in samples]
    if any(p is not None for p in own):
        set_prompts(out, own, pad_id, prompt_width)
        set_images(out, own, [getattr(c, "vision", None) for samples in outs for c in samples])
    attention_mask = torch.cat([out["attention_mask"].long(), real], dim=1)
    out["responses"] = responses
    out["input_ids"] = torch.cat([out["prompts"], responses], dim=1)
    out["attention_mask"] = attention_mask
    out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out["response_mask"] = response_mask
    out["rollout_log_probs"] = logprobs
    if version is not None:
        out["rollout_versions"] = versions
    out["finish_reason"] = finished
    completions = [c for samples in outs for c in samples]
    if completions and getattr(completions[0], "routes", None) is not None:
        out["rollout_routes"] = routes_to_batch(completions, out["prompts"].shape[1], response_width,
                                                attention_mask[:, :out["prompts"].shape[1]].sum(-1).tolist())
    return out


def routes_to_batch(completions: list, prompt_width: int, response_width: int, prompt_lens: list[int]) -> torch.Tensor:
    """int16 [rows, P+R, sparse layers, k] aligned with `input_ids`: each row's recorded experts (`Completion.routes`)
    at its prompt's columns (left-padded) and its response tokens' (right-padded), -1 where none was recorded
    (padding, the last response token, which the engine never fed back)."""
    first = completions[0].routes
    out = torch.full((len(completions), prompt_width + response_width, *first.shape[1:]), -1, dtype=torch.int16)
    for r, (c, length) in enumerate(zip(completions, prompt_lens)):
        fed = c.routes[:length + response_width]
        out[r, prompt_width - length:prompt_width - length + fed.shape[0]] = fed
    return out


def set_prompts(out: Batch, prompts: list[list[int] | None], pad_id: int, width: int = 0) -> None:
    """Rows whose trajectory brought its own prompt (the endpoint's: the runner's first request) get it as
    their `prompts` (left-padded to at least `width`, grown to the longest); the others keep theirs."""
    old, mask = out["prompts"], out["attention_mask"].long()
    width = max([width, old.shape[1]] + [len(p) for p in prompts if p is not None])
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        row = old[r][mask[r].bool()].tolist() if prompt is None else prompt
        ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        real[r, width - len(row):] = 1
    out["prompts"], out["attention_mask"] = ids, real


def set_images(out: Batch, prompts: list[list[int] | None], vision: list[VisionInputs | None]) -> None:
    """Rows whose trajectory brought its own prompt get its images (`vision`: those its prompt and context turns
    hold, in token order; None: none) as their `pixel_values` / `image_grid_thw`; the others keep theirs."""
    old = VisionInputs.unpad_rows(out["pixel_values"], out["image_grid_thw"]) if VISION_KEYS[0] in out \
        else [None] * len(prompts)
    rows = [images if prompt is not None else before for prompt, images, before in zip(prompts, vision, old)]
    if any(row is not None for row in rows):
        for key, tensor in VisionInputs.pad_rows(rows).items():
            out[key] = tensor
    elif VISION_KEYS[0] in out:
        out.pop(*VISION_KEYS)


def add_trajectory_fields(out: Batch, trajectories: list) -> None:
    """Per-row `agent/<stat>` fields of multi-turn rows (the trainer's `agent/...` metrics), `agent/env_error`
    (the environment's first failure, or None), `agent/dropped` (why the trajectory must not be trained on,
    or None), `agent/metric/<name>` (what runners returned beside the reward; None where one did not), and
    each row's own `extra_info` with the trajectory's messages, turns and environment reward (for reward
    functions)."""
    fields = [t.row_fields() for t in trajectories]
    for name in STAT_FIELDS:
        out[f"agent/{name}"] = [f[f"agent/{name}"] for f in fields]
    out["agent/env_error"] = [t.env_error for t in trajectories]
    out["agent/dropped"] = [t.dropped for t in trajectories]
    for name in sorted({k for t in trajectories for k in t.metrics}):
        out[f"agent/metric/{name}"] = [t.metrics.get(name) for t in trajectories]
    infos = out["extra_info"] if "extra_info" in out else [None] * len(trajectories)
    out["extra_info"] = [{**(info or {}), **t.reward_info()} for info, t in zip(infos, trajectories)]
