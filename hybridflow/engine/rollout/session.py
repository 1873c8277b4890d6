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

One session decodes on an engine at a time: sessions share the engine's KV slots and its running-row
buffers (`RolloutEngine.batch`), which a new session resets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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


class Session:
    """See the module docstring. Build it with `RolloutEngine.session(params, hold)`.

    stats: prefill_forwards, prefill_tokens (tokens run through prefill), reused_tokens (cached tokens
    continuations attended over instead of prefilling again), decode_steps, generated_tokens, prefill_s,
    decode_s.
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams, hold: bool = False) -> None:
        self.engine, self.params, self.hold = engine, params, hold
        stop_ids = engine.default_stop_ids if params.stop_token_ids is None else params.stop_token_ids
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        self.generator = torch.Generator(engine.device).manual_seed(seed)
        self.scheduler = Scheduler(engine.kv.num_slots, engine.max_prefill_tokens)
        self.batch = engine.batch
        decode_seed = torch.randint(2**62, (1,), generator=self.generator, device=engine.device)
        self.batch.reset(stop_ids, params.temperature, decode_seed)
        self.running: dict[int, tuple[int, int]] = {}  # slot -> (sequence, its length before this turn)
        self.held: dict[int, _Held] = {}
        self.next_seq = 0
        self.stats: dict[str, float] = dict(prefill_forwards=0, prefill_tokens=0, reused_tokens=0, decode_steps=0,
                                            generated_tokens=0, prefill_s=0.0, decode_s=0.0)

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            return self.params.max_tokens
        if not 1 <= max_tokens <= self.params.max_tokens:
            raise ValueError(f"max_tokens={max_tokens} is invalid; a request may ask for 1 to the session's "
                             f"SamplingParams.max_tokens={self.params.max_tokens} tokens")
        return max_tokens

    def add(self, prompt: list[int], n: int = 1, max_tokens: int | None = None) -> list[int]:
        """Queue a new prompt (token ids, checked by the caller: `check_prompts`) for n samples; returns
        their sequence ids."""
        seqs = list(range(self.next_seq, self.next_seq + n))
        self.next_seq += n
        self.scheduler.add([Request(seqs, list(prompt), self._max_tokens(max_tokens))])
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

    @property
    def has_work(self) -> bool:
        """Whether `step` would run a forward: rows are decoding, or a waiting request can be admitted
        (new prompts wait while every slot is running or held)."""
        return len(self.batch) > 0 or self.scheduler.can_admit()

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Completion]]:
        """Admit and prefill what fits (in forwards of up to `max_prefill_tokens`, queued with no host sync
        between them, so the host builds a forward's inputs while the GPU runs the one before), else decode
        `engine.decode_steps_per_sync` tokens for every running row (fewer when a row reaches its length
        limit sooner); returns the (sequence, completion of this turn) of the rows that finished."""
        admitted = self.scheduler.admit(len(self.batch))
        tick = time.perf_counter()
        prefilled = bool(admitted)
        while admitted:
            self._prefill(sorted(admitted, key=lambda r: r.slots[0]))
            admitted = self.scheduler.admit(len(self.batch))
        if not prefilled and len(self.batch):
            steps = min(self.engine.decode_steps_per_sync, self.batch.steps_left())
            self.engine.decode(self.batch, self.params, self.generator, steps)
            self.stats["decode_steps"] += steps
        elif not prefilled:
            return []
        finished = self.batch.pop_finished()  # syncs, so the timings are real
        self.stats["prefill_s" if prefilled else "decode_s"] += time.perf_counter() - tick
        if finished is None:
            return []
        done = []
        fed = [self.running[slot][1] + len(tokens) - 1 for slot, tokens in zip(finished.slots, finished.token_ids)]
        routes = self.engine.routes.read(finished.slots, fed) if self.engine.routes is not None else \
            [None] * len(fed)
        for slot, tokens, logprobs, stopped, route in zip(finished.slots, finished.token_ids, finished.logprobs,
                                                          finished.stopped, routes):
            seq, before = self.running.pop(slot)
            if self.hold:
                self.held[seq] = _Held(slot, before + len(tokens), tokens[-1])
            done.append((seq, Completion(tokens, logprobs, "stop" if stopped else "length", route)))
            self.stats["generated_tokens"] += len(tokens)
        if not self.hold:
            self.scheduler.release(finished.slots)
        return done

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
