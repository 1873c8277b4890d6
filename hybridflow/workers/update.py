"""The PPO-style update loop shared by the actor, the critic and SFT, and the losses actor and critic train on.

`run_update` makes `passes` passes over this rank's rows (the actor's and critic's `ppo_epochs`, SFT's
`passes_per_batch`), each pass cut into the same number of (shuffled) mini-batches on every rank — one
optimizer step each, verl's semantics: a mini-batch is `mini_batch_rows` rows over all ranks (for the actor
and critic `mini_batch_size x rollout.n`, resolved on the controller: `hybridflow.config.resolved`).
`actor_loss` and `critic_loss` build the engine's `loss_fn` from `hybridflow.algorithms` (policy loss, its
advantages weighted by the rollout correction, + optional KL loss and entropy bonus; clipped value loss),
aggregating with the mini-batch's global token and sequence counts so micro-batching and data
parallelism leave the loss unchanged. Reported loss metrics are the mini-batch's value (exact for
`token-mean`; for sequence-mean modes a token-weighted average of micro-batch values).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from hybridflow.algorithms import aggregate, compute_policy_loss, kl_loss, value_loss
from hybridflow.config.model_schema import EngineOptimConfig, OptimConfig
from hybridflow.config.schema import ActorConfig, CriticConfig
from hybridflow.engine.contracts import LossFunction, TrainEngineContract
from hybridflow.engine.train import LossContext, timed
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.engine.train.microbatch import mini_batch_slices, take_rows
from hybridflow.workers.mismatch import RolloutMismatch


def _agg(cfg: OptimConfig, ctx: LossContext, width: int) -> dict:
    return dict(agg=cfg.loss_agg, global_token_count=ctx.global_tokens, global_seq_count=ctx.global_seqs,
                response_len=width)


def actor_loss(cfg: ActorConfig, use_kl: bool, use_entropy: bool, mismatch: RolloutMismatch | None = None,
               topk_coef: float = 0.0) -> LossFunction:
    """`loss_fn` for `TrainEngine.train_step`: policy loss (+ kl_loss_coef x KL to the reference)
    (- entropy_coef x entropy) (+ topk_coef x the divergence from a distillation teacher's top-k, the forward's
    `topk_kl`, reported as `teacher/topk_kl`). Needs `advantages`, `response_mask` (and `ref_log_probs`); without
    `old_log_probs` (on-policy: one optimizer step per batch) the current log-probs, detached, stand in. Entropy
    is reported whenever the forward computed it. With `mismatch`, the advantages are weighted by the rollout
    correction and the training–inference mismatch is recorded."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask, logp = mb["response_mask"], out["log_probs"]
        agg, scale = _agg(cfg, ctx, mask.shape[1]), ctx.share_to_value(mask)
        old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
        # exact mode's old log-probs are the rollout's: its check compares the update's own forward instead
        measured = logp.detach() if mismatch is not None and mismatch.exact else old
        advantages, corrected = (mb["advantages"], {}) if mismatch is None else mismatch.correct(measured, mb)
        loss, m = compute_policy_loss(cfg.policy_loss, old, logp, advantages, mask, clip_low=cfg.clip_low,
                                      clip_high=cfg.clip_high, clip_c=cfg.clip_c, **agg)
        metrics = {"actor/pg_loss": loss.detach() * scale, "actor/pg_clipfrac": m["pg_clipfrac"],
                   "actor/ppo_kl": m["ppo_kl"], **corrected}
        if use_kl:
            kl = kl_loss(logp, mb["ref_log_probs"], mask, kind=cfg.kl_loss_type, **agg)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach() * scale
        if "entropy" in out:
            entropy = aggregate(out["entropy"], mask, cfg.loss_agg, ctx.global_tokens, ctx.global_seqs,
                                mask.shape[1])
            metrics["actor/entropy"] = entropy.detach() * scale
            if use_entropy:
                loss = loss - cfg.entropy_coef * entropy
        if topk_coef:
            kl = out["topk_kl"]
            loss = loss + topk_coef * aggregate(kl, mask, cfg.loss_agg, ctx.global_tokens, ctx.global_seqs,
                                                mask.shape[1])
            metrics["teacher/topk_kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, metrics

    return loss_fn


def critic_loss(cfg: CriticConfig) -> LossFunction:
    """`loss_fn` for the critic: PPO's clipped value loss. Needs `values` (old), `returns`, `response_mask`."""

    def loss_fn(out: dict, mb: dict, ctx: LossContext):
        mask = mb["response_mask"]
        loss, clipfrac = value_loss(out["values"], mb["returns"], mb["values"], mask,
                                    clip_range=cfg.cliprange_value, **_agg(cfg, ctx, mask.shape[1]))
        vpred = (out["values"].detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"critic/vf_loss": loss.detach() * ctx.share_to_value(mask),
                      "critic/vf_clipfrac": clipfrac, "critic/vpred_mean": vpred}

    return loss_fn


def _mean_over_ranks(values: dict[str, float], engine: TrainEngineContract) -> dict[str, float]:
    keys = sorted(values)
    summed = all_reduce(torch.tensor([values[k] for k in keys], dtype=torch.float64), engine.device)
    return {k: float(v) / engine.world_size for k, v in zip(keys, summed.tolist())}


def run_update(engine: TrainEngineContract, tensors: dict[str, torch.Tensor], cfg: EngineOptimConfig,
               loss_fn: LossFunction, *, passes: int, prefix: str, mini_batch_rows: int | None = None,
               temperature: float = 1.0, with_entropy: bool = False, seed: int = 0, row_group: int = 1,
               soft_targets: float | None = None) -> dict[str, float]:
    """All optimizer steps of one trainer step: `passes` passes over the rows, each cut into mini-batches of
    `mini_batch_rows` rows over all ranks (None: one mini-batch) and those into `cfg`'s micro-batches (runs of
    `row_group` consecutive rows stay in one mini- and micro-batch); metrics identical on every rank.
    `soft_targets`: `TrainEngine.train_step`'s (the loss reads the forward's `topk_kl`).

    Returns the loss metrics averaged over steps, `{prefix}/grad_norm` (mean pre-clip norm),
    `{prefix}/lr` (of the last step), `{prefix}/skipped_steps` (non-finite norms so far),
    `perf/throughput/{prefix}` (real tokens per second per device), `perf/mfu/{prefix}` (on a GPU),
    `perf/compiled/{prefix}` (1 when the layers run compiled).
    """
    rows = tensors["input_ids"].shape[0]
    global_rows = int(all_reduce(torch.tensor([rows]), engine.device).item())
    per_step = global_rows if mini_batch_rows is None else mini_batch_rows
    if per_step <= 0:
        raise ValueError(f"{prefix}.mini_batch_size={cfg.mini_batch_size} gives {per_step} rows per step")
    steps = max(1, math.ceil(global_rows / per_step))
    history: dict[str, list[float]] = defaultdict(list)

    def train() -> None:
        for epoch in range(passes):
            for idx in mini_batch_slices(rows, steps, cfg.shuffle, seed * 1000 + epoch, row_group):
                mb = take_rows(tensors, idx, empty_rows=row_group)
                m = engine.train_step(mb, loss_fn, micro_batch_size=cfg.micro_batch_size,
                                      max_tokens=cfg.max_tokens_per_micro_batch, temperature=temperature,
                                      with_entropy=with_entropy, pack=cfg.use_packing, row_group=row_group,
                                      soft_targets=soft_targets)
                for k, v in m.items():
                    history[k].append(v)

    _, seconds = timed(train, engine.device)
    metrics = {k: sum(v) / len(v) for k, v in history.items() if "/" in k}  # the loss_fn's, not the engine's
    metrics[f"{prefix}/grad_norm"] = sum(history["grad_norm"]) / len(history["grad_norm"])
    metrics[f"{prefix}/lr"] = history["lr"][-1]
    metrics[f"{prefix}/skipped_steps"] = float(engine.skipped_steps)
    seq_lens = tensors["attention_mask"].sum(-1).tolist()
    perf = engine.perf_metrics(seq_lens, seconds, passes=passes)
    local = {f"perf/throughput/{prefix}": perf["throughput"],
             **{f"perf/{k}/{prefix}": v for k, v in engine.compile_metrics().items()}}
    if "mfu" in perf:
        local[f"perf/mfu/{prefix}"] = perf["mfu"]
    if engine.device.type == "cuda":
        local["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    metrics.update(_mean_over_ranks(local, engine))
    return metrics
