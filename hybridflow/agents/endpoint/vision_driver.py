"""`VisionDriver`: a vision-language model's rollout engine (`VisionRolloutEngine`) under the endpoint, with the
interface of `EngineDriver` (`start`, `extend`, `shorten`, `release`, `serve`, `stop`), each turn re-prefilled whole.

The vision engine keeps no live sequence between calls: its `generate` prefills a chunk of prompts with their images
(the tower once per prompt, shared by its n samples), decodes them to their ends and forgets them. So this driver
keeps each sequence on the host instead: its ids (prompt, sampled turns, appended context) and its images in the
order of their tokens. `extend` appends to them, and the next turn is a new prompt of the whole conversation so far:
the tower encodes the conversation's images again and the prefill covers every earlier turn. That is correct (the
engine attends over exactly the ids and pixels the trainer's forward sees, at the positions the family gives the
whole row: `vision_family.forward_kwargs`) and slower than continuing a KV cache: turn k costs a prefill of the conversation's length.

`serve` gathers what waits (new prompts and continued sequences alike) into one `generate` call per (n, max_tokens)
group, run in a worker thread so the event loop goes on reading and rendering requests meanwhile; each call draws
from its own seed (the phase's, when it has one, mixed with the call's number), so equal prompts sent in separate
calls are not sampled alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

from hybridflow.agents.loop.engine_driver import TurnFutures
from hybridflow.data.image_prompts import VisionInputs
from hybridflow.engine.rollout.types import Completion, SamplingParams
from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine


@dataclass
class _Sequence:
    ids: list[int]
    vision: VisionInputs | None


@dataclass
class _Turn:
    """A prompt to generate `len(seqs)` samples of (one per sequence), each at most `max_tokens` tokens."""

    seqs: list[int]
    ids: list[int]
    vision: VisionInputs | None
    max_tokens: int


class VisionDriver(TurnFutures):
    """Futures over a `VisionRolloutEngine` sampling with `params` (see the module docstring)."""

    def __init__(self, engine: VisionRolloutEngine, params: SamplingParams) -> None:
        super().__init__()
        self.engine, self.params = engine, params
        self.sequences: dict[int, _Sequence] = {}
        self.queue: list[_Turn] = []
        self.next_seq = self.calls = 0
        self.prefilled_tokens = 0  # prompt tokens of every call: what continuing a KV cache would have saved

    @property
    def max_group(self) -> int:
        """The most samples one request may ask for: a prompt's samples decode together in one of the engine's
        chunks of `max_num_seqs` rows."""
        return self.engine.max_num_seqs

    def _queue(self, turn: _Turn) -> list[asyncio.Future]:
        self.queue.append(turn)
        return [self._future(seq) for seq in turn.seqs]

    def start(self, prompt: list[int], n: int, max_tokens: int,
              vision: VisionInputs | None = None) -> list[tuple[int, asyncio.Future]]:
        """Queue a prompt's n samples, whose images are `vision`; their sequence ids and first turns' futures."""
        seqs = list(range(self.next_seq, self.next_seq + n))
        self.next_seq += n
        for seq in seqs:
            self.sequences[seq] = _Sequence(list(prompt), vision)
        return list(zip(seqs, self._queue(_Turn(seqs, list(prompt), vision, max_tokens))))

    def extend(self, seq: int, tokens: list[int], max_tokens: int,
               vision: VisionInputs | None = None) -> asyncio.Future:
        """Append `tokens` (holding the images `vision`) to sequence `seq` and generate its next turn over the
        whole sequence."""
        held = self.sequences[seq]
        held.ids += tokens
        if vision is not None:
            held.vision = vision if held.vision is None else VisionInputs.concat([held.vision, vision])
        return self._queue(_Turn([seq], list(held.ids), held.vision, max_tokens))[0]

    def shorten(self, seq: int, drop: int, last_token: int) -> None:
        """Sequence `seq` forgets the last `drop` tokens of its turn (a stop string ended it earlier)."""
        del self.sequences[seq].ids[-drop:]

    def release(self, seq: int) -> None:
        self.sequences.pop(seq, None)

    def describe(self) -> str:
        return (f"{len(self.pending)} turns waiting, {len(self.queue)} prompts queued, {len(self.sequences)} "
                f"sequences held between turns (on the host: the vision engine re-prefills each turn)")

    def _generate(self, turns: list[_Turn], n: int, max_tokens: int) -> list[list[Completion]]:
        """In a worker thread: one `generate` call for turns of `n` samples and one token limit."""
        seed = None if self.params.seed is None else self.params.seed * 1_000_003 + self.calls
        params = dataclasses.replace(self.params, n=n, max_tokens=max_tokens, seed=seed)
        self.calls += 1
        self.prefilled_tokens += sum(len(t.ids) for t in turns)
        return self.engine.generate([t.ids for t in turns], params, vision=[t.vision for t in turns])

    def _resolve(self, turns: list[_Turn], outs: list[list[Completion]]) -> None:
        self.last_step = time.monotonic()
        for turn, completions in zip(turns, outs):
            for seq, completion in zip(turn.seqs, completions):
                if seq in self.sequences:  # else released while it ran (its runner ended)
                    self.sequences[seq].ids += completion.token_ids
                self._settle(seq, completion)

    async def serve(self) -> None:
        """Generate what waits until `stop`; an engine error fails every waiting future, then is raised."""
        try:
            while not self.stopped:
                if not self.queue:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                groups: dict[tuple[int, int], list[_Turn]] = defaultdict(list)
                for turn in self.queue:
                    groups[len(turn.seqs), turn.max_tokens].append(turn)
                self.queue = []
                for (n, max_tokens), turns in groups.items():
                    self.last_step = time.monotonic()
                    self._resolve(turns, await asyncio.to_thread(self._generate, turns, n, max_tokens))
        except Exception as error:
            self._fail(error)
            raise
