"""The controller-side steps of an RL iteration that are plain tensor work on a `Batch`.

Each function takes the step's batch (row keys of docs/architecture.md) and the run config, adds
its outputs as new row keys and returns the metrics it produced, so `rl.py` reads like the
algorithm: rewards (and ReMax's greedy baselines) → DAPO's group filter → (KL in reward) → advantages (with
on-policy distillation's).
No worker calls happen here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow import algorithms
from hybridflow.batch import Batch
from hybridflow.config.resolved import RunFacts
from hybridflow.data.image_prompts import VISION_KEYS
from hybridflow.rewards.failures import EnvironmentFailed
from hybridflow.rewards.manager import RewardResult, scores_to_token_scores


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """The text of each row's response (its real tokens only, special tokens dropped); of a multi-turn row,
    all its turns, the environment's included."""
    responses = batch["responses"]
    real = batch["attention_mask"][:, -responses.shape[1]:].bool()
    return [tokenizer.decode(row[mask].tolist(), skip_special_tokens=True) for row, mask in zip(responses, real)]


def row_scores(batch: Batch, result: RewardResult, cfg: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Each row's score `[B]` (the reward, plus DAPO's overlong penalty when `algorithm.overlong_buffer` is
    enabled) and the reward metrics."""
    scores = torch.tensor(result.scores, dtype=torch.float32)
    metrics = dict(result.metrics)
    buffer = cfg.algorithm.overlong_buffer
    if buffer.enable:
        lengths = batch["response_mask"].sum(-1)
        penalty = algorithms.overlong_penalty(lengths, cfg.data.max_response_length, buffer.len,
                                              buffer.penalty_factor)
        scores = scores + penalty
        metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
    return scores, metrics


def apply_scores(batch: Batch, result: RewardResult, cfg: Any) -> dict[str, float]:
    """Sets `token_scores` (the row's score, `row_scores`, on its last response token), `score` and the
    reward's extras (`reward_extra/<name>`) per row; returns the reward metrics."""
    scores, metrics = row_scores(batch, result, cfg)
    batch["token_scores"] = scores_to_token_scores(scores, batch["response_mask"])
    batch["score"] = [float(s) for s in scores]
    for name, values in result.extras.items():
        batch[f"reward_extra/{name}"] = list(values)
    return metrics


def apply_baselines(batch: Batch, greedy: Batch, result: RewardResult, cfg: Any) -> dict[str, float]:
    """ReMax: sets `baselines` `[B]`, each row's the score (`row_scores`) of its prompt's greedy response.
    `greedy` holds one row per prompt, matched to `batch`'s rows by `uid` (groups may have lost failed
    trajectories); returns `reward/baseline/mean`."""
    scores, _ = row_scores(greedy, result, cfg)
    score_of = dict(zip(greedy["uid"], scores.tolist()))
    missing = sorted({str(uid) for uid in batch["uid"]} - {str(uid) for uid in score_of})
    if missing:
        raise ValueError(f"ReMax baselines: no greedy response for the prompts with uid {missing[:5]}")
    batch["baselines"] = torch.tensor([score_of[uid] for uid in batch["uid"]], dtype=scores.dtype)
    return {"reward/baseline/mean": scores.mean().item()}


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


def compute_advantages(batch: Batch, cfg: Any, facts: RunFacts) -> dict[str, float]:
    """Sets `advantages` and `returns`: the configured estimator's (`algorithm.adv_estimator`) on the scores
    (`facts.task_advantage`), plus, when a teacher scored the rows (`facts.teacher`: `teacher_log_probs`),
    on-policy distillation's per-token advantage (that alone without the task's, and the returns are the
    advantages). The policy's log-probs of its samples are the actor's before the update (`old_log_probs`) or,
    when that pass is skipped, the rollout's. Returns `teacher/kl` (token mean of the reverse-KL estimate) and
    `teacher/log_prob` when distilling."""
    alg, mask = cfg.algorithm, batch["response_mask"]
    if facts.task_advantage:
        advantages, returns = algorithms.compute_advantages(alg.adv_estimator, batch, gamma=alg.gamma, lam=alg.lam,
                                                            scale_by_std=alg.norm_adv_by_std)
    else:
        advantages = returns = torch.zeros_like(mask)
    metrics: dict[str, float] = {}
    if facts.teacher:
        logp = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
        teacher = batch["teacher_log_probs"]
        advantages = advantages + algorithms.distillation_advantages(logp, teacher, mask, cfg.teacher.kl_coef)
        returns = returns if facts.task_advantage else advantages
        metrics = {"teacher/kl": algorithms.masked_mean(logp - teacher, mask).item(),
                   "teacher/log_prob": algorithms.masked_mean(teacher, mask).item()}
    batch["advantages"], batch["returns"] = advantages.float(), returns.float()
    return metrics


def drop_failed_trajectories(batch: Batch) -> Batch:
    """The rows whose multi-turn trajectory may be trained on (`agent/dropped` is None: its runner did not
    fail); the agent metrics of all rows go along in `meta["agent_metrics"]`. Raises when every one failed."""
    if "agent/dropped" not in batch or all(reason is None for reason in batch["agent/dropped"]):
        return batch
    from hybridflow.tracking.metrics import compute_agent_metrics

    keep = torch.tensor([reason is None for reason in batch["agent/dropped"]])
    if not keep.any():  # `hybridflow train` ends on it with this line (exit status 2), not a traceback
        raise EnvironmentFailed(f"every trajectory of this batch failed, the first because "
                                f"{batch['agent/dropped'][0]}; see the agent runner's log lines above")
    metrics = compute_agent_metrics(batch)
    kept = batch[keep]
    kept.meta["agent_metrics"] = metrics
    return kept


def varied_groups(batch: Batch, metric: str) -> torch.Tensor:
    """DAPO dynamic sampling's filter: a row mask `[B]` keeping the groups whose `metric` (`score` or a
    reward extra) varies, the groups that teach something."""
    values = batch["score"] if metric == "score" else batch[f"reward_extra/{metric}"]
    return algorithms.filter_groups(torch.tensor(np.asarray(values, dtype=np.float64)), batch["uid"])


PROMPT_WIDTH_FILL = {"prompts": None, "input_ids": None, "attention_mask": 0, "position_ids": 0}  # None: pad id


def concat_rounds(batches: list[Batch], pad_id: int) -> Batch:
    """`Batch.concat` of batches from different prompt batches (dynamic sampling's rounds), whose prompts
    were left-padded to different widths: the keys that start with the prompt are left-padded to the widest
    first (`pad_id` on token ids, 0 on masks and positions), and a vision model's images (`VisionInputs.pad_rows`)
    zero-padded to the most patches and images of a row."""
    width = max(b["prompts"].shape[1] for b in batches)
    image_widths = {key: max(b[key].shape[1] for b in batches) for key in VISION_KEYS if key in batches[0]}
    padded = []
    for b in batches:
        extra = width - b["prompts"].shape[1]
        b = b.select(*b.keys())
        if extra:
            for key, fill in PROMPT_WIDTH_FILL.items():
                if key in b:
                    b[key] = torch.nn.functional.pad(b[key], (extra, 0), value=pad_id if fill is None else fill)
        for key, most in image_widths.items():
            b[key] = torch.nn.functional.pad(b[key], (0, 0, 0, most - b[key].shape[1]))
        padded.append(b)
    return Batch.concat(padded)


def merge_round_metrics(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several equal-sized generation rounds as one step's: `.../mean` values averaged,
    counts (`reward/errors`, `reward/timeouts`) added up."""
    keys = {k for r in rounds for k in r}
    merged = {k: sum(r.get(k, 0.0) for r in rounds) for k in keys}
    return {k: v / len(rounds) if k.endswith("/mean") else v for k, v in merged.items()}


def sample_rows(batch: Batch, texts: list[str], prompts: list[str], k: int) -> list[dict]:
    """Up to `k` completions with their prompt, score and data source, for logging."""
    return [{"prompt": prompts[i], "response": texts[i], "reward": float(batch["score"][i]),
             "data_source": str(batch["data_source"][i])} for i in range(min(k, len(batch)))]
