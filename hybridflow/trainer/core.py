"""The controller-side steps of an RL iteration that are plain tensor work on a `Batch`.

Each function takes the step's batch (row keys of docs/architecture.md) and the run config, adds
its outputs as new row keys and returns the metrics it produced, so `rl.py` reads like the
algorithm: rewards → (KL in reward) → advantages. No worker calls happen here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow import algorithms
from hybridflow.batch import Batch
from hybridflow.rewards.manager import RewardResult, scores_to_token_scores


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """The text of each row's response (its real tokens only, special tokens dropped)."""
    lengths = batch["response_mask"].sum(-1).long().tolist()
    responses = batch["responses"]
    return [tokenizer.decode(responses[i, :n].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)]


def apply_scores(batch: Batch, result: RewardResult, cfg: Any) -> dict[str, float]:
    """Sets `token_scores` (score on the last response token) and `score` per row; returns reward metrics.

    DAPO's overlong penalty (`algorithm.overlong_buffer`) is added to the scores when enabled.
    """
    scores = torch.tensor(result.scores, dtype=torch.float32)
    metrics = dict(result.metrics)
    buffer = cfg.algorithm.overlong_buffer
    if buffer.enable:
        lengths = batch["response_mask"].sum(-1)
        penalty = algorithms.overlong_penalty(lengths, cfg.data.max_response_length, buffer.len,
                                              buffer.penalty_factor)
        scores = scores + penalty
        metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
    batch["token_scores"] = scores_to_token_scores(scores, batch["response_mask"])
    batch["score"] = [float(s) for s in scores]
    for name, values in result.extras.items():
        batch[f"reward_extra/{name}"] = list(values)
    return metrics


def with_model_scores(result: RewardResult, rm_scores: torch.Tensor | None, weight: float) -> RewardResult:
    """The function scores plus `weight` × the reward model's scores (when there is a reward model)."""
    if rm_scores is None:
        return result
    scores = [s + weight * float(m) for s, m in zip(result.scores, rm_scores.tolist())]
    metrics = {**result.metrics, "reward/model/mean": float(rm_scores.mean()),
               "reward/mean": sum(scores) / max(len(scores), 1)}
    return RewardResult(scores, result.extras, result.errors, metrics)


def apply_kl_in_reward(batch: Batch, kl_ctrl: Any, cfg: Any) -> dict[str, float]:
    """`token_rewards` = `token_scores` − β·KL(actor ‖ reference) when `algorithm.use_kl_in_reward`, else the scores.

    Updates the KL controller with the batch's KL (adaptive control) and reports it.
    """
    if not cfg.algorithm.use_kl_in_reward:
        batch["token_rewards"] = batch["token_scores"]
        return {}
    mask = batch["response_mask"]
    beta = kl_ctrl.value
    batch["token_rewards"] = algorithms.kl_penalty_rewards(batch["token_scores"], batch["old_log_probs"],
                                                           batch["ref_log_probs"], mask, beta,
                                                           cfg.algorithm.kl_penalty)
    current = algorithms.mean_kl(batch["old_log_probs"], batch["ref_log_probs"], mask,
                                 cfg.algorithm.kl_penalty).item()
    kl_ctrl.update(current, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


def compute_advantages(batch: Batch, cfg: Any) -> None:
    """Sets `advantages` and `returns` with the configured estimator (`algorithm.adv_estimator`)."""
    alg = cfg.algorithm
    advantages, returns = algorithms.compute_advantages(alg.adv_estimator, batch, gamma=alg.gamma, lam=alg.lam,
                                                        scale_by_std=alg.norm_adv_by_std)
    batch["advantages"], batch["returns"] = advantages.float(), returns.float()


def group_filter(batch: Batch, metric: str) -> tuple[Batch, dict[str, float]]:
    """DAPO dynamic sampling: the rows of groups whose `metric` varies (groups that teach something)."""
    values = batch["score"] if metric == "score" else batch[f"reward_extra/{metric}"]
    keep = algorithms.filter_groups(torch.tensor(np.asarray(values, dtype=np.float64)), batch["uid"])
    kept = batch[keep]
    return kept, {"filter_groups/kept_ratio": float(keep.float().mean().item())}


def sample_rows(batch: Batch, texts: list[str], prompts: list[str], k: int) -> list[dict]:
    """Up to `k` completions with their prompt, score and data source, for logging."""
    return [{"prompt": prompts[i], "response": texts[i], "reward": float(batch["score"][i]),
             "data_source": str(batch["data_source"][i])} for i in range(min(k, len(batch)))]
