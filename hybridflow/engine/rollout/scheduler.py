"""Continuous batching: which waiting prompts are admitted (prefilled) and when slots come free.

Every iteration of the engine loop first admits as many waiting requests as there are free slots for
(a request needs one slot per sample, n in all) and as the prefill token budget allows; otherwise it
runs one decode step over all running rows. A row that finishes returns its slot at once (unless its
session holds it for a continuation); waiting requests take the free slots as soon as 1/8 of all slots
are free (or all the waiting requests fit, or nothing runs), so one prefill forward serves many prompts
instead of one forward per freed slot. Continuations of live sequences own their slots already and are
admitted first, but gathered the same way: once as many wait as an eighth of the running rows (or nothing
runs), since a prefill forward costs several decode steps and continuations come back a few at a time
(admitted at once, a multi-turn run's prefill time was mostly the overhead of many tiny forwards:
docs/benchmarks.md). Requests are admitted in arrival order; the lowest free slots are handed out first.
"""

from __future__ import annotations

import heapq
from collections import deque

from hybridflow.engine.rollout.sequence import Request


class Scheduler:
    """Slot bookkeeping and the waiting queue for one engine.

    num_slots: KV slots (sequences that may run at once); max_prefill_tokens: prompt tokens one
    prefill forward may pack (a single longer prompt is still admitted alone).
    """

    def __init__(self, num_slots: int, max_prefill_tokens: int) -> None:
        self.num_slots, self.max_prefill_tokens = num_slots, max_prefill_tokens
        self.admit_batch = max(1, num_slots // 8)
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.continuing: deque[Request] = deque()
        self.waiting_slots = 0

    def add(self, requests: list[Request]) -> None:
        """Queue new prompts (slots given on admission) and continuations (which bring their slot)."""
        for request in requests:
            if request.n > self.num_slots:
                raise ValueError(f"SamplingParams.n={request.n} exceeds the engine's {self.num_slots} KV "
                                 f"slots; build the engine with max_num_seqs >= n (or a larger KV budget)")
            if request.slots:
                self.continuing.append(request)
            else:
                self.waiting.append(request)
                self.waiting_slots += request.n

    def join(self, prompt: list[int], max_tokens: int, seqs: list[int]) -> bool:
        """Add samples `seqs` to a new prompt still waiting with the same ids and `max_tokens`, so one prefill
        serves them all, where the merged request still fits the slots; False when none waits. (Not for
        sessions that `withdraw` requests by sequence: it takes a request whole.)"""
        for request in reversed(self.waiting):
            fits = request.n + len(seqs) <= self.num_slots
            if fits and request.max_tokens == max_tokens and request.prompt == prompt:
                request.seqs.extend(seqs)
                self.waiting_slots += len(seqs)
                return True
        return False

    @property
    def has_waiting(self) -> bool:
        return bool(self.waiting or self.continuing)

    def can_admit(self) -> bool:
        """Whether `admit(running=0)` would admit anything."""
        return bool(self.continuing) or bool(self.waiting) and self.waiting[0].n <= len(self.free_slots)

    def admit(self, running: int) -> list[Request]:
        """Pop the continuations (once enough wait), then the waiting requests that fit now (giving each
        its n slots); `running`: rows being decoded (both kinds wait for company while any are)."""
        admitted: list[Request] = []
        tokens = 0
        gathered = len(self.continuing) >= max(1, running // 8) or not running
        while gathered and self.continuing:
            if admitted and tokens + len(self.continuing[0].prompt) > self.max_prefill_tokens:
                return admitted
            admitted.append(self.continuing.popleft())
            tokens += len(admitted[-1].prompt)
        free = len(self.free_slots)
        if free < min(self.admit_batch, self.waiting_slots) and running + len(admitted):
            return admitted
        while self.waiting and self.waiting[0].n <= len(self.free_slots):
            request = self.waiting[0]
            if admitted and tokens + len(request.prompt) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.waiting_slots -= request.n
            request.slots = [heapq.heappop(self.free_slots) for _ in range(request.n)]
            tokens += len(request.prompt)
            admitted.append(request)
        return admitted

    def take(self, count: int) -> list[int]:
        """The `count` lowest free slots, for sequences started outside the queue (`Session.place`)."""
        return [heapq.heappop(self.free_slots) for _ in range(count)]

    def withdraw(self, seqs: set[int] | None) -> list[Request]:
        """Take the waiting new prompts of sequences `seqs` (None: all) out of the queue, whole: a request's
        samples share one prefill, so withdrawing some of them alone is refused."""
        taken: list[Request] = []
        kept: deque[Request] = deque()
        for request in self.waiting:
            chosen = request.seqs if seqs is None else [s for s in request.seqs if s in seqs]
            if not chosen:
                kept.append(request)
                continue
            if len(chosen) != request.n:
                raise ValueError(f"sequences {request.seqs} wait to be prefilled together; withdraw all of them "
                                 f"or none (asked for {chosen})")
            taken.append(request)
            self.waiting_slots -= request.n
        self.waiting = kept
        return taken

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self.free_slots, slot)
