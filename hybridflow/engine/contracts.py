"""The engines' contracts, as `typing.Protocol`s: what a worker may ask of a training engine
(`TrainEngineContract`) and of a rollout engine (`RolloutEngineContract`).

Workers hold their engines by these types, so a type checker holds each engine to the contract and a test
can hand a worker anything that keeps it (a double written from these signatures). `TrainEngine` keeps
the first; `RolloutEngine` and the `transformers.generate` fallback (`HFRolloutEngine`) keep the second.
The shape follows verl's `BaseEngine` (a train step, an inference pass, the per-tensor parameters a
rollout engine loads, moving state off and onto the device), not its code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from hybridflow.engine.rollout.types import Completion, SamplingParams

# loss_fn(outputs of the micro-batch, the micro-batch, its LossContext) -> (its share of the mini-batch
# loss, per-micro-batch metrics); see `TrainEngine.train_step`
LossFunction = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], Any],
                        tuple[torch.Tensor, dict[str, Any]]]


class TrainEngineContract(Protocol):
    """One model role (policy, reference or critic) on this rank: its model, optimizer and schedule, and the
    mechanics of a forward and of a training step (see `hybridflow.engine.train.engine.TrainEngine`)."""

    device: torch.device
    world_size: int
    head: str
    trainable: bool
    compiled: bool
    skipped_steps: int
    optimizer_steps: int  # steps that changed the weights (skipped ones did not)
    model: torch.nn.Module
    optimizer: Any  # a torch optimizer, None when frozen
    scheduler: Any  # its lr schedule, None when frozen
    adapters: Any  # the LoRA adapters (`lora.Adapters`), None without LoRA
    precision: Any  # `model.Precision`: compute, master and reduce dtypes
    config: Any  # the Hugging Face model config

    def infer(self, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None,
              max_tokens: int | None = None, temperature: float = 1.0, with_entropy: bool = False,
              pack: bool = True, row_group: int = 1, eager: bool = False, topk: int = 0) -> dict[str, torch.Tensor]:
        """Log-probs (+ entropy) or values for every row, `[B, R]` float32 on the CPU; runs of `row_group`
        consecutive rows share a micro-batch; `topk` > 0 adds each position's k likeliest tokens (`topk_ids`,
        `topk_log_probs`, `[B, R, k]`)."""
        ...

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFunction,
                   micro_batch_size: int | None = None, max_tokens: int | None = None, temperature: float = 1.0,
                   with_entropy: bool = False, pack: bool = True, row_group: int = 1,
                   soft_targets: float | None = None) -> dict[str, float]:
        """One optimizer step over this rank's share of a mini-batch; metrics averaged over all ranks; runs of
        `row_group` consecutive rows (a preference pair's) share a micro-batch; `soft_targets` (a beta): the
        outputs hold each response token's divergence from the batch's teacher top-k (`topk_kl`)."""
        ...

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Parameter shards and/or optimizer state to host memory."""
        ...

    def onload(self, params: bool = True, optimizer: bool = True) -> None:
        """Parameter shards and/or optimizer state back to the device."""
        ...

    def rollout_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of what a rollout engine needs, one at a time (a collective)."""
        ...

    def rollout_weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of each tensor `rollout_weights` yields, in its order."""
        ...

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """{HF name: tensor} of a LoRA model's frozen weights, which a rollout engine on the same device may hold
        instead of copies (one unsharded rank only)."""
        ...

    def describe(self) -> str:
        """The model's size and dtypes, for messages."""
        ...

    def perf_metrics(self, seq_lens: list[int], seconds: float, passes: int = 1) -> dict[str, float]:
        """Throughput and (on a GPU) MFU of `passes` training passes over rows of `seq_lens` tokens."""
        ...

    def compile_metrics(self) -> dict[str, float]:
        """`compiled`: 1 when the layers run compiled."""
        ...

    def router_metrics(self) -> dict[str, float]:
        """A mixture of experts' agreement with the rollout's recorded routes since the last call, over every rank
        (a collective); {} without router hooks."""
        ...


class RolloutEngineContract(Protocol):
    """A generation engine: samples continuations and takes new weights in place."""

    kind: str  # "fast" (our engine) or "hf" (the transformers.generate fallback)
    device: torch.device
    weight_version: int  # the policy version of its weights, recorded with each sampled token (`Completion.versions`)
    stats: dict[str, float]  # what its last calls measured (the fast engine's: `RolloutEngine.stats`)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """outs[i][j]: the j-th of `params.n` samples for prompt i."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """(HF name, tensor) pairs copied into the engine's weights in place; returns the count."""
        ...

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache (and with `offload_weights` move the weights to the CPU) until `wake`."""
        ...

    def wake(self) -> None:
        """Re-make what `sleep` freed."""
        ...
