"""`Session`: one continuous-batching loop over many sequences, where a sequence that finished a turn may
keep its KV slot and be continued with appended tokens, prefilling only those tokens.

    session = engine.session(SamplingParams(temperature=1.0, max_tokens=256), hold=True)
    a, b = session.add(prompt_ids, n=2)              # sequence ids (the prompt is prefilled once)
    while session.has_work:
        for seq, completion in session.step():       # a prefill, or a few decode steps; the turns that ended
            ...
    session.extend(a, appended_ids, max_tokens=64)   # `a` goes on: its cached KV is reused
    session.shorten(b, drop=3, last_token=t)         # `b` forgets the last 3 tokens of its turn
    session.release(a)                               # `a` is done: its slot is free

`RolloutEngine.generate` is a session without `hold`: a sequence frees its slot when it finishes. With
`hold`, a finished sequence keeps its slot, holding the KV of all its tokens but the last sampled one
(never fed back), until `extend` (which prefills that token and the appended ones at their positions,
attending over the cached prefix) or `release`. A held sequence is not in the running batch, so one
that waits (on a tool, an environment) costs the others nothing, and it re-enters with its
continuation. Sampling settings (temperature, top-k / top-p, stop ids, seed) are the session's;
max_tokens may be lowered per request. Nothing here knows about chat templates or tools.

A session that does not hold its sequences can also `suspend` them unfinished: their tokens so far come
back (log-probs and the weight version of each token included) and their slots are free, so a caller can
carry them across a step boundary or a checkpoint and prefill them again later (partial rollouts,
`hybridflow.workers.partial_rollout`). Each token records the engine's `weight_version` when it was sampled,
so a sequence that runs on across an in-place weight update knows which tokens which weights produced.
`place` starts sequences whose prompts another model prefilled into their slots (a vision-language model through
its own modules, `vision_lm`): their first tokens come from the logits it gives, and the session decodes them as
any other, each row's rotary position shifted by its offset where the engine takes `rope_offsets`.
`reseed` restarts the session's random streams from a seed, so what a session samples next depends on that
seed and its rows alone, not on what it sampled before.

One session decodes on an engine at a time: sessions share the engine's KV slots and its running-row
buffers (`RolloutEngine.batch`), which a new session resets.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.rollout.sampler import sample
from hybridflow.engine.rollout.types import Completion, SamplingParams
from hybridflow.engine.rollout.scheduler import Scheduler
from hybridflow.engine.rollout.sequence import Request

if TYPE_CHECKING:
    from hybridflow.engine.rollout.engine import RolloutEngine


@dataclass
class _Held:
    """A sequence between turns: its slot, its length (prompt + all turns), and its last sampled token,
    the one token of it not yet in the cache."""

    slot: int
    length: int
    last_token: int


@dataclass
class Launched:
    """A step whose GPU work is queued (`Session.launch`): when it started (wall clock, busy clock), whether it
    prefilled, and a CUDA event recorded after its last kernel (`done`; None off CUDA, where it has run)."""

    tick: float
    busy: float
    prefilled: bool
    done: torch.cuda.Event | None


class Session:
    """See the module docstring. Build it with `RolloutEngine.session(params, hold)`.

    stats: prefill_forwards, prefill_tokens (tokens run through prefill), reused_tokens (cached tokens
    continuations attended over instead of prefilling again), decode_steps, generated_tokens, prefill_s,
    decode_s, row_steps (running rows summed over decode steps: / (decode_steps x slots) is how full the
    batch ran), context_steps (the cached positions the decode steps attended over, summed over rows and steps;
    a row that finished inside a run of decode steps counts until it is collected, as its attention still runs),
    busy_s (on CUDA: the GPU's time on the steps' work, `RolloutEngine.busy`; 0 elsewhere).
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams, hold: bool = False) -> None:
        self.engine, self.params, self.hold = engine, params, hold
        stop_ids = engine.default_stop_ids if params.stop_token_ids is None else params.stop_token_ids
        self.scheduler = Scheduler(engine.kv.num_slots, engine.max_prefill_tokens)
        self.batch = engine.batch
        self.batch.reset(stop_ids, params.temperature, torch.zeros(1, dtype=torch.long, device=engine.device))
        self.reseed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        self.version: int | None = None  # the weight version the batch records tokens with
        self.running: dict[int, tuple[int, int]] = {}  # slot -> (sequence, its length before this turn)
        self.held: dict[int, _Held] = {}
        self.next_seq = 0
        self.stats: dict[str, float] = dict(prefill_forwards=0, prefill_tokens=0, reused_tokens=0, decode_steps=0,
                                            generated_tokens=0, prefill_s=0.0, decode_s=0.0, row_steps=0,
                                            context_steps=0, busy_s=0.0)

    def reseed(self, seed: int) -> None:
        """Restart the session's random streams from `seed`: the host generator (prefill sampling, the torch
        sampler) and the fused sampler's device seed drawn from it."""
        self.generator = torch.Generator(self.engine.device).manual_seed(seed)
        self.batch.seed.copy_(torch.randint(2**62, (1,), generator=self.generator, device=self.engine.device))

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.params.max_tokens
        if not 1 <= max_tokens <= self.params.max_tokens:
            raise ValueError(f"max_tokens={max_tokens} is invalid; a request may ask for 1 to the session's "
                             f"SamplingParams.max_tokens={self.params.max_tokens} tokens")
        return max_tokens

    def add(self, prompt: list[int], n: int = 1, max_tokens: int | None = None) -> list[int]:
        """Queue a new prompt (token ids, checked by the caller: `check_prompts`) for n samples; returns
        their sequence ids. In a session that holds its sequences, a prompt equal to one still waiting joins
        it, and one prefill serves both (the endpoint's trajectories of one row each send the same first
        request)."""
        seqs = list(range(self.next_seq, self.next_seq + n))
        self.next_seq += n
        limit = self._max_tokens(max_tokens)
        if not (self.hold and self.scheduler.join(prompt, limit, seqs)):
            self.scheduler.add([Request(seqs, list(prompt), limit)])
        return seqs

    def extend(self, seq: int, tokens: list[int], max_tokens: int | None = None) -> None:
        """Continue held sequence `seq` with `tokens` appended after its last turn, then generate."""
        if seq not in self.held:
            raise ValueError(f"sequence {seq} is not waiting for a continuation (it is running, queued, "
                             f"released, or the session does not hold finished sequences)")
        held = self.held[seq]
        length = held.length + len(tokens)
        if length >= self.engine.max_model_len:
            raise ValueError(f"sequence {seq} would hold {length} tokens, leaving no room for a new one in "
                             f"max_model_len={self.engine.max_model_len}")
        del self.held[seq]
        self.scheduler.add([Request([seq], [held.last_token, *tokens], self._max_tokens(max_tokens),
                                    start=held.length - 1, slots=[held.slot])])

    def shorten(self, seq: int, drop: int, last_token: int) -> None:
        """Forget the last `drop` tokens of held sequence `seq` (a caller that cuts a turn short, e.g. at a
        stop string); `last_token` is its new last token. The cache past the new length is overwritten by
        the next `extend`."""
        held = self.held.get(seq)
        if held is None or not 0 <= drop < held.length:
            raise ValueError(f"cannot drop {drop} tokens of sequence {seq}: it is not held or holds fewer")
        held.length -= drop
        held.last_token = last_token

    def release(self, seq: int) -> None:
        """Free held sequence `seq`'s slot (it is finished for good)."""
        if seq not in self.held:
            raise ValueError(f"sequence {seq} is not held (it is running, queued, or already released)")
        self.scheduler.release([self.held.pop(seq).slot])

    def suspend(self, seqs: Iterable[int] | None = None) -> dict[int, Completion]:
        """Take sequences `seqs` (None: every one) out unfinished and free their slots: a running one's
        completion holds its tokens so far, a queued one's is empty (finish_reason "suspended"). Sequences
        that already finished are not here (`step` returned them). Only for sessions that do not hold."""
        if self.hold:
            raise ValueError("suspend is for sessions that do not hold their sequences (hold=False)")
        wanted = None if seqs is None else set(seqs)
        out = {seq: Completion([], [], "suspended") for r in self.scheduler.withdraw(wanted) for seq in r.seqs}
        slots = {slot for slot, (seq, _) in self.running.items() if wanted is None or seq in wanted}
        taken = self.batch.pop_slots(slots)
        for slot, tokens, logprobs, versions in zip(taken.slots, taken.token_ids, taken.logprobs, taken.versions):
            out[self.running.pop(slot)[0]] = Completion(tokens, logprobs, "suspended", versions=versions)
            self.stats["generated_tokens"] += len(tokens)
        self.scheduler.release(taken.slots)
        return out

    @property
    def free_slots(self) -> int:
        """Slots no sequence runs in, holds or waits for: what `place` may take now."""
        return len(self.scheduler.free_slots)

    @torch.inference_mode()
    def place(self, lengths: list[int], n: int, logits: torch.Tensor,
              rope_offsets: list[int] | None = None) -> list[tuple[list[int], list[int]]]:
        """Start n samples of each of the prompts another model prefilled: prompt i, of lengths[i] tokens, takes n
        free slots now and its samples' first tokens are drawn from its last position's logits[i] (logits [P, V]).
        The caller writes prompt i's K/V to positions [0, lengths[i]) of its slots before the next `step`.
        rope_offsets: per prompt, added to its rows' positions for the rotary embedding alone (an engine built with
        `rope_offsets`); None: 0. -> per prompt, (its sequence ids, their slots)."""
        need = n * len(lengths)
        if need > self.free_slots:
            raise ValueError(f"{len(lengths)} prompts x {n} samples need {need} slots; {self.free_slots} are free")
        self._sync_version()
        slots = self.scheduler.take(need)
        tokens, logprobs = sample(logits.repeat_interleave(n, dim=0), self.params, self.generator,
                                  never=self.engine.never_sample)
        placed, max_gen = [], []
        for i, length in enumerate(lengths):
            seqs, mine = list(range(self.next_seq, self.next_seq + n)), slots[i * n:(i + 1) * n]
            self.next_seq += n
            for seq, slot in zip(seqs, mine):
                self.running[slot] = (seq, length)
            max_gen += [min(self.params.max_tokens, self.engine.max_model_len - length)] * n
            placed.append((seqs, mine))
        offsets = [o for o in (rope_offsets or [0] * len(lengths)) for _ in range(n)]
        self.batch.add(slots, [length for length in lengths for _ in range(n)], max_gen, tokens, logprobs, offsets)
        return placed

    def started(self) -> set[int]:
        """The sequences admitted and decoding: their prefill has sampled their first tokens."""
        return {seq for seq, _ in self.running.values()}

    @property
    def has_work(self) -> bool:
        """Whether `step` would run a forward: rows are decoding, or a waiting request can be admitted
        (new prompts wait while every slot is running or held)."""
        return len(self.batch) > 0 or self.scheduler.can_admit()

    def step(self) -> list[tuple[int, Completion]]:
        """Admit and prefill what fits (in forwards of up to `max_prefill_tokens`, queued with no host sync
        between them, so the host builds a forward's inputs while the GPU runs the one before), else decode
        `engine.decode_steps_per_sync` tokens for every running row (fewer when a row reaches its length
        limit sooner); returns the (sequence, completion of this turn) of the rows that finished."""
        launched = self.launch()
        return [] if launched is None else self.collect(launched)

    @torch.inference_mode()
    def launch(self) -> Launched | None:
        """`step`'s first half: queue its GPU work and return without waiting for it (None: nothing to run).
        Until `collect`, the caller may do host work beside the GPU's (`hybridflow.agents.loop.engine_driver` serves
        HTTP requests) and `add`, `extend`, `shorten` or `release` sequences, which touch only the queue and
        the held slots; the next `launch` admits what they queued."""
        self._sync_version()
        admitted = self.scheduler.admit(len(self.batch))
        if not admitted and not len(self.batch):
            return None
        tick, busy = time.perf_counter(), self.engine.busy.seconds
        prefilled = bool(admitted)
        while admitted:
            self._prefill(sorted(admitted, key=lambda r: r.slots[0]))
            admitted = self.scheduler.admit(len(self.batch))
        if not prefilled:
            steps, rows = min(self.engine.decode_steps_per_sync, self.batch.steps_left()), len(self.batch)
            # a row at position p attends over p + 1 positions, one more each step
            context = steps * (sum(self.batch.host_positions) + rows) + rows * steps * (steps - 1) // 2
            self.stats["context_steps"] += context
            self.engine.decode(self.batch, self.params, self.generator, steps)
            self.stats["decode_steps"] += steps
            self.stats["row_steps"] += steps * rows
        self.engine.busy.stop()
        done = None
        if self.engine.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(tick, busy, prefilled, done)

    @torch.inference_mode()
    def collect(self, launched: Launched) -> list[tuple[int, Completion]]:
        """`step`'s second half, after `launch`: read the finished rows back (waiting for the GPU if it is still
        at work); the (sequence, completion of this turn) of each."""
        finished = self.batch.pop_finished()  # syncs, so the timings are real
        self.stats["prefill_s" if launched.prefilled else "decode_s"] += time.perf_counter() - launched.tick
        self.engine.busy.settle()
        self.stats["busy_s"] += self.engine.busy.seconds - launched.busy
        if finished is None:
            return []
        done = []
        fed = [self.running[slot][1] + len(tokens) - 1 for slot, tokens in zip(finished.slots, finished.token_ids)]
        routes = self.engine.routes.read(finished.slots, fed) if self.engine.routes is not None else \
            [None] * len(fed)
        for slot, tokens, logprobs, versions, stopped, route in zip(finished.slots, finished.token_ids,
                                                                    finished.logprobs, finished.versions,
                                                                    finished.stopped, routes):
            seq, before = self.running.pop(slot)
            if self.hold:
                self.held[seq] = _Held(slot, before + len(tokens), tokens[-1])
            done.append((seq, Completion(tokens, logprobs, "stop" if stopped else "length", route, versions)))
            self.stats["generated_tokens"] += len(tokens)
        if not self.hold:
            self.scheduler.release(finished.slots)
        return done

    def _sync_version(self) -> None:
        """The batch records tokens with the engine's current weight version."""
        if self.version != self.engine.weight_version:
            self.version = self.engine.weight_version
            self.batch.version.fill_(self.version)

    def run(self) -> dict[int, Completion]:
        """Step until nothing can run; the completion of each sequence's turn that ended meanwhile."""
        out: dict[int, Completion] = {}
        while self.has_work:
            out.update(self.step())
        return out

    def _prefill(self, admitted: list[Request]) -> None:
        tokens, logprobs = self.engine.prefill(admitted, self.params, self.generator)
        slots, lengths, max_gen = [], [], []
        for r in admitted:
            length = r.start + len(r.prompt)
            for seq, slot in zip(r.seqs, r.slots):
                self.running[slot] = (seq, length)
                slots.append(slot)
                lengths.append(length)
                max_gen.append(min(r.max_tokens, self.engine.max_model_len - length))
        self.batch.add(slots, lengths, max_gen, tokens, logprobs)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += sum(len(r.prompt) for r in admitted)
        self.stats["reused_tokens"] += sum(r.start for r in admitted)

