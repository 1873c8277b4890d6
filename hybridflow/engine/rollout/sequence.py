"""Per-request and per-running-row state of one generation session (a `generate` call or an agent loop).

A `Request` is one prompt with its n samples (one KV slot each once admitted), or the appended tokens
of one live sequence, which already owns its slot and has `start` tokens cached there. The `RunningBatch`
keeps the rows being decoded as device tensors, so a decode step costs a handful of tensor ops and one
host sync no matter how many rows run: Python touches a row only when it joins or finishes. Rows are
kept sorted by slot. Generated tokens and log-probs go into per-slot output buffers and are read back
once, when the row finishes.
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
    """Rows that finished in one step, read back to the host: their slots and outputs."""

    slots: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]


class RunningBatch:
    """The decoding rows of a call. Shapes: B running rows, S slots (+1 scratch), M = max_tokens.

    slots [B], positions [B] (where the next input token goes; context length - 1), tokens [B] (the
    last sampled token, the next input), generated [B] (tokens so far), max_gen [B] (the row's limit).
    """

    def __init__(self, num_slots: int, max_tokens: int, stop_token_ids: list[int], device: torch.device):
        self.device = device
        self.out_tokens = torch.zeros(num_slots + 1, max_tokens, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(num_slots + 1, max_tokens, dtype=torch.float32, device=device)
        self.stop_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self.slots = self.positions = self.tokens = self.generated = self.max_gen = empty

    def __len__(self) -> int:
        return self.slots.shape[0]

    def add(self, slots: list[int], positions: list[int], max_gen: list[int], tokens: torch.Tensor,
            logprobs: torch.Tensor) -> None:
        """Join rows whose first token ([R] tokens/logprobs) was sampled from their prompt's prefill."""
        def as_long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        new_slots = as_long(slots)
        self.out_tokens[new_slots, 0] = tokens
        self.out_logprobs[new_slots, 0] = logprobs
        ones = torch.ones_like(new_slots)
        self._set(torch.cat([self.slots, new_slots]), torch.cat([self.positions, as_long(positions)]),
                  torch.cat([self.tokens, tokens]), torch.cat([self.generated, ones]),
                  torch.cat([self.max_gen, as_long(max_gen)]))
        order = torch.argsort(self.slots)
        self._select(order)

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append one decode step's sampled tokens/logprobs ([B]) to every row."""
        self.out_tokens[self.slots, self.generated] = tokens
        self.out_logprobs[self.slots, self.generated] = logprobs
        self.tokens = tokens
        self.generated = self.generated + 1
        self.positions = self.positions + 1

    def pop_finished(self) -> Finished | None:
        """Remove the rows that hit a stop token or their length limit; None if none did (one sync)."""
        stopped = torch.isin(self.tokens, self.stop_ids)
        done = stopped | (self.generated >= self.max_gen)
        if not bool(done.any()):
            return None
        idx = done.nonzero()[:, 0]
        slots, gens = self.slots[idx], self.generated[idx]
        width = int(gens.max())
        tokens = self.out_tokens[slots, :width].tolist()
        logprobs = self.out_logprobs[slots, :width].tolist()
        gens_list, stopped_list = gens.tolist(), stopped[idx].tolist()
        finished = Finished(slots.tolist(), [t[:g] for t, g in zip(tokens, gens_list)],
                            [lp[:g] for lp, g in zip(logprobs, gens_list)], stopped_list)
        self._select((~done).nonzero()[:, 0])
        return finished

    def _set(self, slots, positions, tokens, generated, max_gen) -> None:
        self.slots, self.positions, self.tokens = slots, positions, tokens
        self.generated, self.max_gen = generated, max_gen

    def _select(self, idx: torch.Tensor) -> None:
        self._set(self.slots[idx], self.positions[idx], self.tokens[idx], self.generated[idx],
                  self.max_gen[idx])
