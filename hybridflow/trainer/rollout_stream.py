"""`RolloutStream`: where each RL step's generated rows come from, and the policy version of their tokens.

The policy version of the weights is the number of actor updates so far (`policy_version`); each token of a
step's rows records the version that sampled it (`rollout_versions`). By default a step generates `rollout.n`
responses to its prompts with the weights it trains (version = the step's). Two modes train on rows that other
weights generated, in part or in full:

- **Partial rollouts** (`rollout.partial`). Each rollout rank keeps an in-flight buffer of prompt groups
  (`hybridflow.workers.partial_rollout`). A step first drops the groups whose oldest token lags the version
  they will train at by more than `rollout.max_staleness` (`in_flight`), tops the buffer up with prompt
  batches from the train loader to `1 + rollout.partial_extra_batches` batches in flight (the loop's batch is
  always one of them), then takes `data.train_batch_size` complete groups, oldest first (`generate_groups`);
  the rest go on in the next step. With `rollout.partial_stale=finish` (the default) the generation also
  finishes the groups the next step would drop (`_next_keeps`), up to a step's share, and trains them first.
  A step reads as before, with "take the groups that are complete" in place of "generate a batch".
- **Pipelining** (`rollout.pipeline`, `rollout.placement=separate`). While step k scores and trains its rows,
  the rollout group already generates step k+1's, with the weights before step k's update (one version
  behind: staleness 1); step k's weight sync, queued behind that generation on the rollout ranks, feeds the
  one after. The first step generates its own batch and draws the next prompt batch, so the loop's batch of
  step k is the one step k+1 trains. With partial rollouts on too, the call submitted early is step k+1's
  `generate_groups`.

A checkpoint keeps what is in flight (`state_dict`): every rank's buffer (ids, log-probs, versions; the
samples are suspended to the host, and the next step prefills them again, in this run and in a run resumed
from the checkpoint alike) and, pipelined, the generated rows of the next step (the save waits for them). The
loader's position is the trainer's own checkpoint entry.

Metrics: every run gets `generation_metrics`: `perf/gen/batch_occupancy` (running rows over KV slots,
averaged over decode steps), `perf/gen/generated_tokens` (tokens sampled in the step's generation, those of
samples carried over or later dropped included), `perf/gen/mean_context` (the cached positions a decoded token
attended over, on average), `perf/gen/kv_read_tb_s` (the keys and values those decode steps read, over the
generation's wall time: a rank's rate, to hold against its memory bandwidth) and, on CUDA,
`perf/gen/gpu_busy_share` (the GPU's time on the engine's steps over the generation's wall time,
`RolloutEngine.busy`). With partial rollouts or pipelining,
`rollout_metrics`: `rollout/staleness_mean` and `rollout/staleness_max` (per trained sample: the step's version
minus the version of its oldest token), `rollout/off_policy_token_share` (trained response tokens sampled by older
weights); with partial rollouts, `rollout/carried_over` (samples left in flight for the next steps) and
`rollout/dropped` (samples dropped for staleness when this step's generation started) and, with
`rollout.partial_stale=finish`, `rollout/stale_finished` (samples of groups the generation went on to finish
because the next step would have dropped them) and `timing_s/gen_stale_wait` (the longest rank's wall time doing
so).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.config.resolved import RunFacts
from hybridflow.controller import per_rank, submit
from hybridflow.data.loader import BatchLoader
from hybridflow.engine.rollout import SamplingParams
from hybridflow.trainer.step_math import concat_rounds
from hybridflow.workers.handles import RolloutHandle

logger = logging.getLogger(__name__)
DROP_WARN_SHARE = 0.1  # of a step's samples (dropped + trained) dropped for staleness: warn once


def policy_version(facts: RunFacts, warmup_steps: int, step: int) -> int:
    """The actor updates made before trainer step `step` (0-based): every step's, except, in a run with a
    critic, the first `warmup_steps` (`critic.warmup_steps`), which update the critic alone."""
    return step - min(step, warmup_steps) if facts.critic else step


def generation_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """`perf/gen/...` from every rank's generation stats (`RolloutReplica.generation_stats`); {} without any."""
    stats = [s for s in stats if s]
    if not stats:
        return {}
    slot_steps = sum(s["decode_steps"] * s["num_slots"] for s in stats)
    row_steps, gen_s = sum(s["row_steps"] for s in stats), max(sum(s["gen_s"] for s in stats), 1e-9)
    out = {"perf/gen/batch_occupancy": row_steps / slot_steps} if slot_steps else {}
    out["perf/gen/generated_tokens"] = float(sum(s["generated_tokens"] for s in stats))
    if row_steps:
        out["perf/gen/mean_context"] = sum(s["context_steps"] for s in stats) / row_steps
        out["perf/gen/kv_read_tb_s"] = sum(s["context_steps"] * s["kv_token_bytes"] for s in stats) / gen_s / 1e12
    busy = sum(s["busy_s"] for s in stats)
    if busy > 0:
        out["perf/gen/gpu_busy_share"] = busy / gen_s
    return out


def rollout_metrics(batch: Batch, version: int) -> dict[str, float]:
    """Staleness of rows trained at policy `version` (see the module docstring), from `rollout_versions`."""
    mask = batch["response_mask"] > 0
    versions = batch["rollout_versions"].long()
    oldest = torch.where(mask, versions, torch.full_like(versions, version)).min(dim=-1).values
    staleness = (version - oldest).float()
    older = ((versions < version) & mask).sum()
    return {"rollout/staleness_mean": staleness.mean().item(), "rollout/staleness_max": staleness.max().item(),
            "rollout/off_policy_token_share": (older / mask.sum().clamp(min=1)).item()}


class RolloutStream:
    """The generated rows of each step (see the module docstring).

    Args:
        cfg: the run's `RLConfig` (its `rollout` keys, `data.train_batch_size`, `critic.warmup_steps`).
        facts: what the config implies (`RunFacts`: the rollout ranks, a critic, off-policy rows).
        sampling: how a training step samples (`hybridflow.trainer.role_configs.train_sampling`).
        rollout: the handle that generates (the actor, or the separate rollout group).
        loader: the train loader (partial rollouts top up from it; pipelining draws the next batch).
        pad_id: the prompts' pad id (rows of several prompt batches are left-padded to the widest).
    """

    def __init__(self, cfg: Any, facts: RunFacts, sampling: SamplingParams, rollout: RolloutHandle,
                 loader: BatchLoader, pad_id: int) -> None:
        self.cfg, self.facts, self.sampling = cfg, facts, sampling
        self.rollout, self.loader, self.pad_id = rollout, loader, pad_id
        self.ranks = facts.rollout_ranks
        self.share = cfg.data.train_batch_size // self.ranks  # groups each rank gives a step (partial)
        self.pending: Future[tuple[Batch, dict[str, float]]] | tuple[Batch, dict[str, float]] | None = None
        self.warned_of_drops = False

    def next_batch(self, prompts: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """Step `step`'s rows (`prompts`: the loop's batch for it, or a dynamic-sampling round's) and their
        metrics."""
        version = policy_version(self.facts, self.cfg.critic.warmup_steps, step)
        if not self.cfg.rollout.pipeline:
            batch, metrics = self._resolve(self._submit(prompts, step, version, version))
        else:
            if self.pending is None:  # the first step: its own batch now, the next one from the loader
                self.pending = self._submit(prompts, step, version, version)
                prompts = self.loader.next_batch()
            batch, metrics = self._resolve(self.pending)
            self.pending = self._submit(prompts, step + 1, version, version + 1)
        if self.facts.off_policy:
            metrics.update(rollout_metrics(batch, version))
        return batch, metrics

    def _submit(self, prompts: Batch, step: int, version: int,
                train_version: int) -> Future[tuple[Batch, dict[str, float]]]:
        """Starts generating the rows of step `step` with the rollout's weights at `version`, to be trained at
        `train_version`; returns the future of `(rows, metrics)`. The seed of `sampling` (`trainer.seed`) is
        mixed with the number of the prompt batch in the run (several a step with dynamic sampling) or, with
        partial rollouts, where one call serves several batches, with the step."""
        cfg = self.cfg
        dropped = 0
        if cfg.rollout.partial:
            counts = per_rank(self.rollout.in_flight)(train_version - cfg.rollout.max_staleness)
            dropped = sum(c["dropped"] for c in counts)
            have, batches = min(c["groups"] for c in counts) + self.share, [prompts]
            while have < (1 + cfg.rollout.partial_extra_batches) * self.share:
                batches.append(self.loader.next_batch())
                have += self.share
            prompts = concat_rounds(batches, self.pad_id) if len(batches) > 1 else prompts
            seed_step = step
        else:
            served = self.loader.state_dict()
            seed_step = served["epoch"] * len(self.loader) + served["position"] - 1
        call = (submit(per_rank(self.rollout.generate_groups), prompts, self.sampling, seed_step, version, self.share,
                       self._next_keeps(step) if cfg.rollout.partial_stale == "finish" else None)
                if cfg.rollout.partial else
                submit(per_rank(self.rollout.generate_versioned), prompts, self.sampling, seed_step, version))
        out: Future[tuple[Batch, dict[str, float]]] = Future()

        def done(f: Future[list[tuple[Batch, dict[str, float]]]]) -> None:
            try:
                out.set_result(self._collect(f.result(), dropped))
            except BaseException as exc:  # noqa: BLE001 - the caller's result() raises it
                out.set_exception(exc)

        call.add_done_callback(done)
        return out

    def _next_keeps(self, step: int) -> int:
        """The oldest policy version the call after this one (which generates the rows of step `step`) keeps in
        flight: the version its rows train at, less `rollout.max_staleness`. Pipelined, that call generates with
        the weights after step `step`'s update and trains one version later."""
        warmup = self.cfg.critic.warmup_steps
        trains = (policy_version(self.facts, warmup, step) + 1 if self.cfg.rollout.pipeline
                  else policy_version(self.facts, warmup, step + 1))
        return trains - self.cfg.rollout.max_staleness

    def _collect(self, ranks: list[tuple[Batch, dict[str, float]]], dropped: int) -> tuple[Batch, dict[str, float]]:
        """(rows, metrics) from every rank's (rows, generation stats)."""
        batches, stats = zip(*ranks)
        metrics = generation_metrics(list(stats))
        rows = concat_rounds(list(batches), self.pad_id)
        if self.cfg.rollout.partial:
            metrics.update({"rollout/carried_over": float(sum(s["in_flight"] for s in stats)),
                            "rollout/dropped": float(dropped)})
            if self.cfg.rollout.partial_stale == "finish":
                metrics.update({"rollout/stale_finished": float(sum(s["stale_finished"] for s in stats)),
                                "timing_s/gen_stale_wait": max(s["stale_wait_s"] for s in stats)})
            self._warn_of_drops(dropped, len(rows))
        return rows, metrics

    def _warn_of_drops(self, dropped: int, trained: int) -> None:
        """Once a run: a step that dropped more than `DROP_WARN_SHARE` of its samples for staleness. They are
        the groups still decoding two versions after their prefill (a quarter of the samples on the H200 with
        `rollout.partial_stale=drop`: docs/long_reasoning.md), so the run trains on fewer samples than it
        generates; the metric alone is easy to miss. With `finish` only the groups beyond a step's share are
        dropped, which the config check's bound on `rollout.partial_extra_batches` keeps from happening in the
        model of bench/partial_sim.py."""
        if self.warned_of_drops or dropped <= DROP_WARN_SHARE * (dropped + trained):
            return
        self.warned_of_drops = True
        r = self.cfg.rollout
        remedy = ("set rollout.partial_stale=finish, " if r.partial_stale == "drop" else
                  "(rollout.partial_stale=finish finishes only as many as a step trains) ")
        logger.warning("partial rollouts dropped %d samples as too stale against %d trained this step: samples "
                       "that take longer than rollout.max_staleness=%d steps to finish are thrown away with "
                       "their work; %sraise rollout.max_staleness or lower rollout.partial_extra_batches=%d "
                       "(rollout/dropped counts them every step)", dropped, trained, r.max_staleness, remedy,
                       r.partial_extra_batches)

    @staticmethod
    def _resolve(pending: Future[tuple[Batch, dict[str, float]]] | tuple[Batch, dict[str, float]]
                 ) -> tuple[Batch, dict[str, float]]:
        batch, metrics = pending.result() if isinstance(pending, Future) else pending
        return batch, dict(metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every rank's in-flight buffer, and the next step's rows when pipelined (waited for)."""
        pending = None
        if self.pending is not None:
            self.pending = self._resolve(self.pending)
            pending = {"batch": self.pending[0].state_dict(), "metrics": self.pending[1]}
        return {"partial": per_rank(self.rollout.partial_state)() if self.cfg.rollout.partial else [],
                "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`; buffers saved by another number of rollout ranks are dealt out anew."""
        if self.cfg.rollout.partial:
            self.rollout.load_partial_state(redistribute(state["partial"], self.ranks))
        pending = state["pending"]
        self.pending = None if pending is None else (Batch.from_state_dict(pending["batch"]), pending["metrics"])


def redistribute(states: list[dict[str, Any]], ranks: int) -> list[dict[str, Any]]:
    """Per-rank buffer states for `ranks` ranks: as saved when the count is the same, else every group dealt out
    in turn, oldest first (the counts of a step's shares then match again)."""
    if len(states) == ranks:
        return states
    groups = sorted(((g["order"], i, g) for i, s in enumerate(states) for g in s["groups"]), key=lambda t: t[:2])
    top = max((s["next_order"] for s in states), default=0)
    return [{"next_order": top, "groups": [g for _, _, g in groups[r::ranks]]} for r in range(ranks)]

