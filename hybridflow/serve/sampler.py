"""Sampling for the service: one `RolloutEngine` per base model, switched between saved weight snapshots.

A snapshot is what `save_weights_for_sampler` keeps: (HF name, tensor) of every weight that differs from the
base directory's (a LoRA client's merged weights, a full-parameter client's every weight).
`Sampler.sample(key, snapshot, prompts, params)` loads that snapshot into the engine when another one (or the
base) is loaded (the engine updates its weights in place), generates `params.n` samples of every prompt in one
engine batch (the prompts of several clients' requests) and returns each one's tokens, per-token log-probs and
finish reason. Sampling from the base model reloads the replaced weights from the model directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.engine import checkpoint_tensors

Snapshot = list[tuple[str, torch.Tensor]]


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

    def sample(self, key: str | None, snapshot: Snapshot | None, prompts: list[list[int]],
               params: SamplingParams) -> list[list[tuple[list[int], list[float], str]]]:
        """`params.n` samples of each prompt under the snapshot `key` (None: the base), all in one engine batch:
        per prompt, (tokens, log-probs, finish reason) per sample."""
        # the fast engine runs a prompt's samples side by side (they share its prefill); the fallback takes any n
        slots = self.engine.kv.num_slots if isinstance(self.engine, RolloutEngine) else params.n
        if params.n > slots:
            raise ValueError(f"num_samples={params.n} is more than the sampling engine's {slots} sequences at once; "
                             f"ask for at most {slots}, or restart hybridflow serve with a larger --max-num-seqs "
                             f"or --kv-cache-memory")
        self._load(key, snapshot)
        return [[(list(c.token_ids), [float(x) for x in c.logprobs], c.finish_reason) for c in completions]
                for completions in self.engine.generate(prompts, params)]
