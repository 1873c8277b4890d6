"""Standard per-step metrics computed from a step's batch, its timings and its validation scores.

The batch is a `hybridflow.batch.Batch` or any mapping with the row keys of docs/architecture.md:
``responses [B, R]``, ``response_mask [B, R]``, ``prompts [B, P]``, ``attention_mask [B, P+R]`` and,
when the step computed them, ``token_scores``, ``token_rewards``, ``advantages``, ``returns``,
``values`` (all ``[B, R]``). Token-level quantities are averaged over real response tokens only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def _get(batch: Any, key: str) -> torch.Tensor | None:
    return batch[key] if key in batch else None


def _masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of `values` over positions where `mask` is set; NaNs when the mask is empty."""
    picked = values[mask.bool()].float()
    if picked.numel() == 0:
        return (float("nan"),) * 3
    return picked.mean().item(), picked.max().item(), picked.min().item()


def compute_data_metrics(batch: Any, max_response_length: int | None = None) -> dict[str, float]:
    """Rewards, lengths, advantages, returns and values of one step.

    Args:
        batch: see the module docstring; ``response_mask``, ``prompts`` and ``attention_mask`` are required.
        max_response_length: the generation limit, for ``response_length/clip_ratio`` (the share of
            responses that hit it); default: the response width ``R``.

    Returns:
        ``reward/{mean,max,min}`` (per-sequence sums of ``token_scores``), ``reward/with_kl/mean`` (of
        ``token_rewards``), ``response_length/{mean,max,min,clip_ratio}`` (of a multi-turn row: all its turns,
        environment tokens included), ``prompt_length/{mean,max}``,
        ``advantages/{mean,max,min}``, ``returns/{mean,max,min}``, ``values/{mean,max,min}``, each only
        when its inputs are in the batch.
    """
    response_mask = batch["response_mask"]
    prompt_width = batch["prompts"].shape[1]
    response_len = batch["attention_mask"][:, prompt_width:].sum(-1).float()  # multi-turn: all turns
    prompt_len = batch["attention_mask"][:, :prompt_width].sum(-1).float()
    limit = max_response_length or response_mask.shape[1]
    metrics = {
        "response_length/mean": response_len.mean().item(),
        "response_length/max": response_len.max().item(),
        "response_length/min": response_len.min().item(),
        "response_length/clip_ratio": (response_len >= limit).float().mean().item(),
        "prompt_length/mean": prompt_len.mean().item(),
        "prompt_length/max": prompt_len.max().item(),
    }
    scores = _get(batch, "token_scores")
    if scores is not None:
        seq = scores.sum(-1).float()
        metrics.update({"reward/mean": seq.mean().item(), "reward/max": seq.max().item(),
                        "reward/min": seq.min().item()})
    rewards = _get(batch, "token_rewards")
    if rewards is not None:
        metrics["reward/with_kl/mean"] = rewards.sum(-1).float().mean().item()
    for key in ("advantages", "returns", "values"):
        values = _get(batch, key)
        if values is not None:
            mean, high, low = _masked_stats(values, response_mask)
            metrics.update({f"{key}/mean": mean, f"{key}/max": high, f"{key}/min": low})
    return metrics


AGENT_MEANS = ("turns", "tool_calls", "env_seconds", "env_reward", "segments")
AGENT_COUNTS = ("tool_errors", "env_errors", "cut_by_budget", "kv_reused_tokens", "token_mismatch", "runner_errors",
                "late_requests")


def compute_agent_metrics(batch: Any) -> dict[str, float]:
    """Statistics of multi-turn rows, from the rollout's per-row ``agent/<stat>`` fields: per trajectory
    ``agent/{turns,tool_calls,env_seconds,env_reward,segments}/mean`` and ``agent/turns/max``; summed over
    the step ``agent/{tool_errors,env_errors,cut_by_budget,kv_reused_tokens,token_mismatch,runner_errors,
    late_requests}`` and ``agent/dropped`` (trajectories left out); ``agent/env_error_share``, the share of
    trajectories whose environment failed; ``agent/metric/<name>/mean`` over the rows whose runner returned
    that metric. A batch whose dropped rows were taken out carries the metrics of the whole rollout in
    ``batch.meta["agent_metrics"]``, returned as they are. ``{}`` for single-turn rows."""
    if "agent_metrics" in getattr(batch, "meta", {}):
        return dict(batch.meta["agent_metrics"])
    rows = batch
    if "agent/turns" not in rows:
        return {}
    column = {name: [float(v) for v in rows[f"agent/{name}"]] for name in AGENT_MEANS + AGENT_COUNTS}
    metrics = {f"agent/{name}/mean": sum(column[name]) / max(len(column[name]), 1) for name in AGENT_MEANS}
    metrics["agent/turns/max"] = max(column["turns"], default=0.0)
    metrics.update({f"agent/{name}": sum(column[name]) for name in AGENT_COUNTS})
    metrics["agent/env_error_share"] = sum(v > 0 for v in column["env_errors"]) / max(len(column["env_errors"]), 1)
    if "agent/dropped" in rows:
        metrics["agent/dropped"] = float(sum(reason is not None for reason in rows["agent/dropped"]))
    for key in rows.keys():
        if key.startswith("agent/metric/"):
            values = [float(v) for v in rows[key] if v is not None]
            metrics[f"{key}/mean"] = sum(values) / max(len(values), 1)
    return metrics


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the wall time of the ``with`` block to ``timings[name]`` (seconds; repeated blocks add up).
    The block is a ``phase/<name>`` range for the torch profiler (bench/grpo_vs_trl.py --profile measures
    how busy the GPU is in each)."""
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(f"phase/{name}"):
            yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def compute_timing_metrics(timings: Mapping[str, float], batch: Any = None) -> dict[str, float]:
    """``timing_s/<name>`` for each timing; with `batch`, also ``timing_per_token_ms/<name>``.

    Per-token times divide by the response tokens for ``gen`` (what generation produces) and by all
    prompt + response tokens for every other stage (what the forward passes read). ``step`` is the
    whole step and has no per-token entry.
    """
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timings.items()}
    if batch is not None:
        response_tokens = batch["response_mask"].sum().item()
        all_tokens = batch["attention_mask"].sum().item()
        for name, seconds in timings.items():
            tokens = response_tokens if name == "gen" else all_tokens
            if name != "step" and tokens:
                metrics[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens
    return metrics


def compute_throughput(batch: Any, step_time: float, n_gpus: int = 1) -> dict[str, float]:
    """``perf/throughput``: prompt + response tokens of the step per second per device.

    Also ``perf/total_num_tokens`` and ``perf/time_per_step``.
    """
    if step_time <= 0 or n_gpus < 1:
        raise ValueError(f"step_time must be > 0 and n_gpus >= 1, got {step_time}, {n_gpus}")
    tokens = float(batch["attention_mask"].sum().item())
    return {"perf/throughput": tokens / step_time / n_gpus, "perf/total_num_tokens": tokens,
            "perf/time_per_step": float(step_time)}


def compute_validation_metrics(data_sources: Sequence[str], scores: Sequence[float],
                               extras: Mapping[str, Sequence[Any]] | None = None) -> dict[str, float]:
    """``val/reward/mean`` over all rows, ``val/<data_source>/reward/mean`` per source, and the same for
    each numeric reward extra (``val/<name>/mean``, ``val/<data_source>/<name>/mean``)."""
    if len(data_sources) != len(scores):
        raise ValueError(f"{len(data_sources)} data sources but {len(scores)} scores")
    columns: dict[str, Sequence[Any]] = {"reward": scores, **(extras or {})}
    metrics: dict[str, float] = {}
    for name, values in columns.items():
        overall: list[float] = []
        by_source: dict[str, list[float]] = defaultdict(list)
        for source, value in zip(data_sources, values):
            if isinstance(value, (int, float)):
                overall.append(float(value))
                by_source[str(source)].append(float(value))
        if overall:
            metrics[f"val/{name}/mean"] = sum(overall) / len(overall)
            for source, vals in sorted(by_source.items()):
                metrics[f"val/{source}/{name}/mean"] = sum(vals) / len(vals)
    return metrics
