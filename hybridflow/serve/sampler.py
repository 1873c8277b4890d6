"""Sampling for the service: one `RolloutEngine` per base model, switched between saved weight snapshots.

A snapshot is what `save_weights_for_sampler` keeps: (HF name, tensor) of every weight that differs from the
base directory's (a LoRA client's merged weights, a full-parameter client's every weight).
`Sampler.stream(key, snapshot, params, prompts, more, done)` loads that snapshot into the engine when another one (or
the base) is loaded (the engine updates its weights in place) and generates `params.n` samples of every prompt in one
engine session (continuous batching: the prompts of several clients' requests), taking in the prompts `more()` gives
between two steps and handing each prompt's samples (tokens, per-token log-probs, finish reason) to `done` as soon as
they have all ended, with the prompt's log-probs (and top-k) where asked (`scoring.prompt_logprobs`: what the SDK's
`compute_logprobs` asks for). Sampling from the base model reloads the replaced weights from the model directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.checkpoint_files import checkpoint_tensors
from hybridflow.engine.rollout.scoring import PromptLogprobs, prompt_logprobs
from hybridflow.engine.rollout.types import Completion, check_prompts

Snapshot = list[tuple[str, torch.Tensor]]
Samples = list[tuple[list[int], list[float], str]]  # per sample of one prompt: tokens, log-probs, finish reason
Sampled = tuple[Samples, PromptLogprobs | None]  # a prompt's samples, and its prompt log-probs where asked
Prompts = list[tuple[int, list[int]]]  # (id, prompt)


def _samples(completions: list[Completion]) -> Samples:
    return [(list(c.token_ids), [float(x) for x in c.logprobs], c.finish_reason) for c in completions]


class Sampler:
    """The rollout engine of one base model and which weights it holds now (a snapshot's path, or None: base)."""

    def __init__(self, path: str | Path, device: str, max_num_seqs: int, dtype: torch.dtype = torch.float32,
                 kv_cache_memory: float | None = None, max_model_len: int | None = None) -> None:
        self.path = Path(path)
        self.engine = RolloutEngine.from_pretrained(path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                                    kv_cache_memory=kv_cache_memory, max_model_len=max_model_len)
        self.loaded: str | None = None
        self.adapted: set[str] = set()  # weights a snapshot replaced, reloaded from disk to go back to the base

    def _load(self, key: str | None, snapshot: Snapshot | None) -> None:
        if key == self.loaded:
            return
        if snapshot is None:
            self.engine.load_weights(checkpoint_tensors(self.path, keep=lambda name: name in self.adapted))
        else:
            self.adapted |= {name for name, _ in snapshot}
            self.engine.load_weights(snapshot)
        self.loaded = key

    def stream(self, key: str | None, snapshot: Snapshot | None, params: SamplingParams, prompts: Prompts,
               more: Callable[[], Prompts], done: Callable[[int, Sampled | Exception], None],
               score: int | None = None) -> None:
        """`params.n` samples of each (id, prompt) of `prompts` under the snapshot `key` (None: the base), in one
        engine session that also takes in what `more()` returns between its steps; `done(id, (samples, scores))` as
        each prompt's samples have all ended, or `done(id, error)` for a prompt the engine refuses. With `score` (a
        number k), scores are the prompt's log-probs and its top-k (k > 0) under the same weights
        (`scoring.prompt_logprobs`, the admitted prompts in one call); without, None."""
        # the fast engine runs a prompt's samples side by side (they share its prefill); the fallback takes any n
        slots = self.engine.kv.num_slots if isinstance(self.engine, RolloutEngine) else params.n
        if params.n > slots:
            raise ValueError(f"num_samples={params.n} is more than the sampling engine's {slots} sequences at once; "
                             f"ask for at most {slots}, or restart hybridflow serve with a larger --max-num-seqs "
                             f"or --kv-cache-memory")
        self._load(key, snapshot)
        scores: dict[int, PromptLogprobs | None] = {}

        def held(new: Prompts) -> Prompts:
            """The prompts the engine can hold, scored where asked."""
            kept = self._held(new, done)
            found = prompt_logprobs(self.engine, [p for _, p in kept], score) if score is not None and kept else []
            scores.update({i: found[j] if found else None for j, (i, _) in enumerate(kept)})
            return kept

        if not isinstance(self.engine, RolloutEngine):  # the fallback generates one batch; later requests wait
            kept = held(prompts)
            for (i, _), completions in zip(kept, self.engine.generate([p for _, p in kept], params)):
                done(i, (_samples(completions), scores.pop(i)))
            return
        session = self.engine.session(params)
        owners: dict[int, tuple[int, int]] = {}  # sequence -> (prompt id, its sample's index)
        pending: dict[int, list[Completion | None]] = {}

        def admit(new: Prompts) -> None:
            for i, prompt in held(new):
                pending[i] = [None] * params.n
                owners.update({seq: (i, j) for j, seq in enumerate(session.add(prompt, params.n))})

        admit(prompts)
        while session.has_work:
            for seq, completion in session.step():
                i, j = owners.pop(seq)
                pending[i][j] = completion
                if all(c is not None for c in pending[i]):
                    done(i, (_samples([c for c in pending.pop(i) if c is not None]), scores.pop(i)))
            admit(more())

    def _held(self, prompts: Prompts, done: Callable[[int, Sampled | Exception], None]) -> Prompts:
        """The (id, prompt) pairs the engine can hold; each other one is answered at once with why, alone."""
        held = []
        for i, prompt in prompts:
            try:
                check_prompts([prompt], self.engine.max_model_len, self.engine.config.vocab_size,
                              longer="restart hybridflow serve with a larger --max-model-len")
            except ValueError as e:
                done(i, e)
                continue
            held.append((i, prompt))
        return held
