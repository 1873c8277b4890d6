"""Per-request and per-running-row state of one generation session (a `generate` call or an agent loop).

A `Request` is one prompt with its n samples (one KV slot each once admitted), or the appended tokens
of one live sequence, which already owns its slot and has `start` tokens cached there. The `RunningBatch`
keeps the rows being decoded in fixed device buffers owned by the engine (so CUDA graphs can be captured
over them): rows [0, B) are live, sorted by slot; rows [B, capacity) are padding (the KV cache's scratch
slot, already finished). A decode step samples and records a token for every row that has not finished
(`record`), entirely on the device; the host looks only when it asks which rows finished
(`pop_finished`, one sync), so several decode steps can run between two looks. A finished row is
recognised from its state alone (its last token is a stop id, or it has its `max_gen` tokens): it
records nothing more and its position stops advancing, so its outputs are exactly those of
one-step-at-a-time decoding and its (wasted) cache writes stay at its own last position. Generated
tokens, log-probs and the weight version that sampled each token go into per-slot output buffers and are
read back once, when the row finishes or is taken out unfinished (`pop_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """Tokens to prefill for the sequences `seqs` (n samples of one prompt, or one continued sequence).

    prompt: the token ids to run through the model (a continuation: the tokens not yet in its cache).
    max_tokens: the most tokens to generate for each sample of this request.
    start: tokens of the sequence already in its slot (0 for a new prompt).
    slots: the n slots the samples run in (given on admission; a continuation brings its own).
    """

    seqs: list[int]
    prompt: list[int]
    max_tokens: int
    start: int = 0
    slots: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.seqs)


@dataclass
class Finished:
    """Rows taken out of the batch (finished since the last look, or suspended), read back to the host:
    their slots and outputs."""

    slots: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    stopped: list[bool]


class RunningBatch:
    """The decoding rows, in fixed buffers of `capacity` rows. Per row: slots, positions (where the next
    input token goes; context length - 1), tokens (the last sampled token, the next input), generated
    (tokens so far), max_gen (the row's limit), rope_offsets (added to the row's positions for its rotary
    embedding alone: a vision-language prompt's rope delta, `vision_lm`; 0 otherwise). Per session (`reset`): is_stop [V] (the stop ids as a
    mask), inv_temp [1] and seed [1] (the fused sampler's, advanced by one per decode step on the device).
    version [1]: the weight version each sampled token is recorded with (set by the session between steps).
    Output buffers [slots + 1, width]: the last row is the scratch row finished rows write to.

    The host mirrors each live row's slot, position and remaining steps (`steps_left`), so it can bound a
    run of decode steps without reading the device.
    """

    def __init__(self, capacity: int, scratch_slot: int, width: int, vocab_size: int,
                 device: torch.device) -> None:
        self.capacity, self.scratch_slot, self.device = capacity, scratch_slot, device
        def longs(fill: int = 0) -> torch.Tensor:
            return torch.full((capacity,), fill, dtype=torch.long, device=device)

        self.slots, self.positions, self.tokens = longs(scratch_slot), longs(), longs()
        self.generated, self.max_gen, self.rope_offsets = longs(), longs(), longs()
        self.out_tokens = torch.zeros(scratch_slot + 1, width, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(scratch_slot + 1, width, dtype=torch.float32, device=device)
        self.out_versions = torch.zeros(scratch_slot + 1, width, dtype=torch.int32, device=device)
        self.version = torch.zeros(1, dtype=torch.int32, device=device)
        self.is_stop = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.inv_temp = torch.ones(1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.host_slots: list[int] = []
        self.host_positions: list[int] = []
        self.host_left: list[int] = []

    def __len__(self) -> int:
        return len(self.host_slots)

    def reset(self, stop_token_ids: list[int], temperature: float, seed: torch.Tensor) -> None:
        """Start a session: no rows, its stop ids (ids outside the vocabulary can never be sampled),
        temperature and decode seed ([1] int64 on the device)."""
        self.clear()
        self.is_stop.zero_()
        vocab = self.is_stop.shape[0]
        ids = [t for t in stop_token_ids if t < vocab]
        if ids:
            self.is_stop[torch.tensor(ids, device=self.device)] = True
        self.inv_temp.fill_(1.0 / max(temperature, 1e-6))
        self.seed.copy_(seed)

    def clear(self) -> None:
        """Drop every row (all padding)."""
        self._pad(0)
        self.host_slots, self.host_positions, self.host_left = [], [], []

    def add(self, slots: list[int], positions: list[int], max_gen: list[int], tokens: torch.Tensor,
            logprobs: torch.Tensor, rope_offsets: list[int] | None = None) -> None:
        """Join rows whose first token ([R] tokens/logprobs) was sampled from their prompt's prefill (rope_offsets:
        per row, None for 0)."""
        def as_long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        new_slots, size = as_long(slots), len(self)
        self.out_tokens[new_slots, 0] = tokens
        self.out_logprobs[new_slots, 0] = logprobs
        self.out_versions[new_slots, 0] = self.version
        all_slots = self.host_slots + list(slots)
        order = sorted(range(len(all_slots)), key=all_slots.__getitem__)
        index = torch.tensor(order, device=self.device)
        for buffer, new in ((self.slots, new_slots), (self.positions, as_long(positions)),
                            (self.tokens, tokens), (self.generated, torch.ones_like(new_slots)),
                            (self.max_gen, as_long(max_gen)),
                            (self.rope_offsets, as_long(rope_offsets or [0] * len(slots)))):
            buffer[:len(order)] = torch.cat([buffer[:size], new])[index]
        positions_all = self.host_positions + list(positions)
        left_all = self.host_left + [g - 1 for g in max_gen]
        self.host_slots = [all_slots[i] for i in order]
        self.host_positions = [positions_all[i] for i in order]
        self.host_left = [left_all[i] for i in order]

    def steps_left(self) -> int:
        """Decode steps until the first live row reaches its length limit (a stop token may come sooner)."""
        return min(self.host_left)

    def max_position(self) -> int:
        """The largest position a live row's next input token goes to."""
        return max(self.host_positions)

    def done(self, size: int) -> torch.Tensor:
        """[size] bool: the row has finished (its last token is a stop id, or it has max_gen tokens)."""
        return self.is_stop[self.tokens[:size]] | (self.generated[:size] >= self.max_gen[:size])

    def record(self, size: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append one decode step's sampled tokens/logprobs ([size]) to the rows [0, size) that have not
        finished; a finished row (padding included) keeps its state and writes to the scratch row. Device
        ops only (no sync): this runs inside the decode CUDA graph."""
        live = ~self.done(size)
        row = torch.where(live, self.slots[:size], self.scratch_slot)
        column = torch.where(live, self.generated[:size], 0)
        self.out_tokens.index_put_((row, column), tokens)
        self.out_logprobs.index_put_((row, column), logprobs)
        self.out_versions.index_put_((row, column), self.version.expand(size))
        self.tokens[:size].copy_(torch.where(live, tokens, self.tokens[:size]))
        step = live.long()
        self.generated[:size].add_(step)
        self.positions[:size].add_(step)

    def advanced(self, steps: int) -> None:
        """The host's side of `steps` decode steps (rows that finished meanwhile leave at `pop_finished`)."""
        self.host_positions = [p + steps for p in self.host_positions]
        self.host_left = [n - steps for n in self.host_left]

    def pop_finished(self) -> Finished | None:
        """Remove the rows that hit a stop token or their length limit; None if none did (one sync)."""
        gone = [i for i, finished in enumerate(self.done(len(self)).tolist()) if finished]
        return self._remove(gone) if gone else None

    def pop_slots(self, slots: set[int]) -> Finished:
        """Remove the live rows of `slots`, finished or not, with their outputs so far."""
        return self._remove([i for i, slot in enumerate(self.host_slots) if slot in slots])

    def _remove(self, gone: list[int]) -> Finished:
        """Take rows `gone` (indices into the live rows) out, reading their outputs back; the rest close up."""
        size = len(self)
        idx = torch.tensor(gone, dtype=torch.long, device=self.device)
        slots, gens = self.slots[idx], self.generated[idx]
        gens_list = gens.tolist()
        width = max(gens_list, default=0)
        outputs = [buffer[slots, :width].tolist() for buffer in (self.out_tokens, self.out_logprobs, self.out_versions)]
        tokens, logprobs, versions = ([row[:g] for row, g in zip(rows, gens_list)] for rows in outputs)
        finished = Finished([self.host_slots[i] for i in gone], tokens, logprobs, versions,
                            self.is_stop[self.tokens[idx]].tolist())
        keep = sorted(set(range(size)) - set(gone))
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for buffer in (self.slots, self.positions, self.tokens, self.generated, self.max_gen, self.rope_offsets):
            buffer[:len(keep)] = buffer[index]
        self._pad(len(keep), size)
        self.host_slots = [self.host_slots[i] for i in keep]
        self.host_positions = [self.host_positions[i] for i in keep]
        self.host_left = [self.host_left[i] for i in keep]
        return finished

    def _pad(self, start: int, end: int | None = None) -> None:
        """Make rows [start, end) padding: the scratch slot, position 0, finished (max_gen 0)."""
        self.slots[start:end] = self.scratch_slot
        for buffer in (self.positions, self.tokens, self.generated, self.max_gen, self.rope_offsets):
            buffer[start:end] = 0
