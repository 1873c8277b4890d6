"""`PartialRollouts`: one rank's in-flight buffer of partial rollouts, the prompt groups whose samples are being
generated across trainer steps, with the policy version of every token.

A trainer step asks for a number of complete groups (all n samples of a prompt finished, `take`). The buffer
queues into its engine session every sample that is not running (new prompts, and samples carried over
unfinished) and steps the session until that many groups are complete, oldest first; the rest stay in flight.
A step's new prompts arrive with `add`, before the step's `take`; the sampling settings come with each `take`
(the trainer's: the same every step but for the seed).

Unfinished samples cross the step boundary in one of two ways (`rollout.partial_unfinished`):
- `continue`: they stay in the session, holding their KV slots, and decode on in the next step under the
  weights loaded in place in between; the prefix's keys and values are those computed when its tokens were;
- `recompute`: at the end of each step they are suspended to the host (tokens, log-probs, versions; their
  slots freed), and the next step prefills prompt + tokens so far again, under the new weights.
Saving a checkpoint (`state_dict`) and any other generation on the engine (validation) suspend every sample
the same way: the next step starts a fresh session and prefills them, as a run resumed from that checkpoint
does, so both continue identically. Each step reseeds the session from the step's sampling seed, so what it
samples depends on the step and the samples in flight, not on the session's history. A session samples with
the settings of the `take` that started it.

`in_flight(oldest_version)` drops the groups whose oldest token is older than the given policy version (they
would train too far off-policy: `rollout.max_staleness`), samples and all (groups are trained whole), and counts
them. The samples of a group start together (one prefill), so its oldest token is any of its first tokens. With
`rollout.partial_stale=finish` a `take` is told the version the next step will keep (`finish_before`), and goes on
generating until the groups from earlier steps that the next step would drop are complete, and takes them first:
their work is trained instead of thrown away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.data.loader import left_pad
from hybridflow.engine.rollout import Completion, RolloutEngine, SamplingParams
from hybridflow.engine.rollout.session import Session
from hybridflow.engine.rollout.types import FinishReason

UNFINISHED_MODES = ("continue", "recompute")
STAT_KEYS = ("busy_s", "row_steps", "context_steps", "decode_steps", "generated_tokens")  # session stats a step reports


@dataclass
class Sample:
    """One sample of a group: its tokens so far, their log-probs and versions; `finish` once finished (the
    engine's finish reason), `seq` while it is queued or running in the session."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    seq: int | None = None

    def extend(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.seq = None
        if completion.finish_reason != "suspended":
            self.finish = completion.finish_reason


@dataclass(eq=False)
class Group:
    """A prompt's n samples, with its position in the order prompts arrived (`order`, older first), its token
    ids and its row's other fields (uid, data_source, ground_truth, ...). `first_version` is the policy version
    its prefill sampled at, once it has run: the versions of samples still decoding in the session are not on the
    host."""

    order: int
    prompt: list[int]
    fields: dict[str, Any]
    samples: list[Sample]
    first_version: int | None = None

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def predates(self, version: int) -> bool:
        """Whether its oldest token is older than policy `version` (False before its prefill)."""
        oldest = self.oldest_version
        return oldest is not None and oldest < version

    @property
    def oldest_version(self) -> int | None:
        """The policy version of its oldest token (None before its prefill)."""
        return min([s.versions[0] for s in self.samples if s.versions]
                   + ([self.first_version] if self.first_version is not None else []), default=None)


class PartialRollouts:
    """The buffer of one rank (see the module docstring).

    Args:
        engine: the fast rollout engine (the samples in flight live in its sessions).
        unfinished: `rollout.partial_unfinished`, "continue" or "recompute".
    """

    def __init__(self, engine: RolloutEngine, unfinished: str) -> None:
        if unfinished not in UNFINISHED_MODES:
            raise ValueError(f"rollout.partial_unfinished={unfinished!r} is invalid; valid: "
                             f"{', '.join(UNFINISHED_MODES)}")
        self.engine, self.unfinished = engine, unfinished
        self.groups: list[Group] = []
        self.session: Session | None = None
        self.next_order = 0
        # the session's stats when a take last reported them, and what sessions since dropped had counted after
        # that (a sample's tokens are counted when it finishes or is suspended, also outside a take: a dropped
        # group, a checkpoint, validation), so each take reports every token generated exactly once
        self.reported = dict.fromkeys(STAT_KEYS, 0.0)
        self.unreported = dict.fromkeys(STAT_KEYS, 0.0)

    # ------------------------------------------------------------------ a step
    def add(self, prompts: list[list[int]], fields: list[dict[str, Any]], n: int) -> None:
        """New prompt groups of `n` samples (token ids and row fields), queued behind those in flight."""
        for prompt, row in zip(prompts, fields):
            self.groups.append(Group(self.next_order, list(prompt), dict(row), [Sample() for _ in range(n)]))
            self.next_order += 1

    def in_flight(self, oldest_version: int) -> dict[str, int]:
        """Drop the groups whose oldest token predates `oldest_version`; {"groups": groups left in flight,
        "dropped": samples dropped now}."""
        stale = [g for g in self.groups if g.predates(oldest_version)]
        live = [s.seq for g in stale for s in g.samples if s.seq is not None]
        if live and self.session is not None:
            self.session.suspend(live)
        self.groups = [g for g in self.groups if g not in stale]
        return {"groups": len(self.groups), "dropped": sum(len(g.samples) for g in stale)}

    def take(self, count: int, version: int, params: SamplingParams,
             finish_before: int | None = None) -> tuple[list[Group], dict[str, float]]:
        """Generate with `params` (its seed, when set, reseeds the session), the engine's weights at policy
        `version`, until `count` groups are complete; returns the `count` oldest complete groups (taken out of
        the buffer) and this call's generation stats: the session's `STAT_KEYS` counted over the call, `gen_s`
        (its wall time), `in_flight` (samples left), `num_slots` (the engine's KV slots) and `kv_token_bytes`.

        `finish_before` (`rollout.partial_stale=finish`: the oldest version the next step keeps): the generation
        also goes on until the groups started in earlier calls whose oldest token predates it are complete (the
        `count` oldest of them; the next step drops any others), and they are taken first. The stats then add
        `stale_finished` (the samples of those still running once `count` groups were complete: what the drop
        policy throws away) and `stale_wait_s` (the wall time spent finishing them). Groups started in this call
        are never waited for: that would be synchronous generation."""
        if len(self.groups) < count:
            raise ValueError(f"the buffer holds {len(self.groups)} groups; a step takes {count}")
        overdue = [] if finish_before is None else [g for g in self.groups if g.predates(finish_before)][:count]
        self.engine.weight_version = version
        if self.session is None:
            self.session = self.engine.session(params)
        session = self.session
        if params.seed is not None:
            session.reseed(params.seed)
        running = self._queue(session)
        tick = time.perf_counter()
        while sum(g.complete for g in self.groups) < count:
            self._step(session, running, count)
        enough_at, waited = time.perf_counter(), [g for g in overdue if not g.complete]
        while not all(g.complete for g in waited):
            self._step(session, running, count)
        stats = {k: session.stats[k] - self.reported[k] + self.unreported[k] for k in STAT_KEYS}
        self.reported, self.unreported = {k: session.stats[k] for k in STAT_KEYS}, dict.fromkeys(STAT_KEYS, 0.0)
        stats["gen_s"] = time.perf_counter() - tick
        if finish_before is not None:
            stats["stale_finished"] = sum(len(g.samples) for g in waited)
            stats["stale_wait_s"] = time.perf_counter() - enough_at
        started = session.started()
        for g in self.groups:  # prefilled in this call, at `version`: the samples' own versions stay in the engine
            if g.first_version is None and any(s.seq in started for s in g.samples):
                g.first_version = version
        first = {id(g) for g in overdue}
        complete = sorted((g for g in self.groups if g.complete), key=lambda g: (id(g) not in first, g.order))[:count]
        self.groups = [g for g in self.groups if g not in complete]
        if self.unfinished == "recompute":
            self.suspend()
        stats["in_flight"] = sum(len(g.samples) for g in self.groups)
        stats["num_slots"], stats["kv_token_bytes"] = self.engine.kv.num_slots, self.engine.kv.token_bytes
        return complete, stats

    def _step(self, session: Session, running: dict[int, Sample], count: int) -> None:
        """One engine step of `session`; the samples it finished or stopped take their tokens."""
        if not session.has_work:
            raise RuntimeError(f"the session ran out of work with {sum(g.complete for g in self.groups)} of {count} "
                               f"groups complete")
        for seq, completion in session.step():
            running.pop(seq).extend(completion)

    def _queue(self, session: Session) -> dict[int, Sample]:
        """Queue every sample that is neither finished nor in `session`, oldest group first: a group not yet
        started as one prompt of n samples (one prefill), a sample with tokens as prompt + tokens so far (with
        what is left of the session's `max_tokens`). Returns every sample in the session by its sequence id."""
        for g in self.groups:
            waiting = [s for s in g.samples if s.finish is None and s.seq is None]
            if not waiting:
                continue
            if len(waiting) == len(g.samples) and not any(s.tokens for s in waiting):
                for s, seq in zip(waiting, session.add(g.prompt, len(waiting))):
                    s.seq = seq
                continue
            for s in waiting:
                (s.seq,) = session.add(g.prompt + s.tokens, 1, session.params.max_tokens - len(s.tokens))
        return {s.seq: s for g in self.groups for s in g.samples if s.seq is not None}

    def suspend(self) -> None:
        """Every sample in the session back to the host (its tokens so far kept); the next `take` starts a
        fresh session."""
        if self.session is None:
            return
        by_seq = {s.seq: s for g in self.groups for s in g.samples if s.seq is not None}
        for seq, completion in self.session.suspend().items():
            by_seq[seq].extend(completion)
        self.unreported = {k: self.unreported[k] + self.session.stats[k] - self.reported[k] for k in STAT_KEYS}
        self.reported = dict.fromkeys(STAT_KEYS, 0.0)
        self.session = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The groups in flight (every sample suspended first), as tensors and plain data."""
        self.suspend()
        return {"next_order": self.next_order, "groups": [group_state(g) for g in self.groups],
                "unreported": dict(self.unreported)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s groups (all suspended: the next `take` prefills them)."""
        self.suspend()
        self.next_order = int(state["next_order"])
        self.groups = [group_from_state(g) for g in state["groups"]]
        self.unreported = {k: float(state.get("unreported", {}).get(k, 0.0)) for k in STAT_KEYS}


def group_state(group: Group) -> dict[str, Any]:
    return {"order": group.order, "prompt": torch.tensor(group.prompt, dtype=torch.long), "fields": group.fields,
            "samples": [{"tokens": torch.tensor(s.tokens, dtype=torch.long),
                         "logprobs": torch.tensor(s.logprobs, dtype=torch.float32),
                         "versions": torch.tensor(s.versions, dtype=torch.int32), "finish": s.finish or ""}
                        for s in group.samples]}


def group_from_state(state: dict[str, Any]) -> Group:
    return Group(int(state["order"]), state["prompt"].tolist(), dict(state["fields"]),
                 [Sample(s["tokens"].tolist(), s["logprobs"].tolist(), s["versions"].tolist(), s["finish"] or None)
                  for s in state["samples"]])


def groups_to_prompts(groups: list[Group], pad_id: int) -> tuple[Batch, list[list[Completion]]]:
    """The prompt rows of `groups` (left-padded to their longest) and each group's samples as completions."""
    ids, mask = left_pad([g.prompt for g in groups], pad_id)
    keys = list(groups[0].fields) if groups else []
    prompts = Batch({"prompts": ids, "attention_mask": mask}, {k: [g.fields[k] for g in groups] for k in keys})
    outs = [[finished(s) for s in g.samples] for g in groups]
    return prompts, outs


def finished(sample: Sample) -> Completion:
    """A finished sample as the engine's `Completion`."""
    if sample.finish is None:
        raise ValueError("a sample still in flight has no completion: only complete groups are trained")
    return Completion(sample.tokens, sample.logprobs, sample.finish, versions=sample.versions)
