"""The decode step, eager or replayed from CUDA graphs captured at bucketed batch sizes.

A decode step is two halves, each defined once here and used by both the eager path and the capture:
`decode_forward` (build the attention metadata from the rows' slots and positions, run the model,
return logits) and `sample_and_record` (draw a token per row, record it into the `RunningBatch`,
advance the decode seed). `DecodeGraphs` captures both at batch sizes 1, 2, 4, 8, 16, 32, then every
32 up to the batch capacity, directly over the engine's `RunningBatch` buffers: a step of B rows
replays the smallest bucket >= B, whose rows past B are the batch's padding rows (the KV cache's
scratch slot, already finished), so nothing is copied in or out and no kernel is launched from Python.
The second half is captured once per sampling mode (greedy, sampled) when the fused sampler applies;
with top-k / top-p it runs eagerly on the captured forward's logits. Nothing in a step reads the
device back, so the host queues several steps before it looks for finished rows.

The graphs hold raw pointers to the weights, the cache and the batch buffers: weights are updated in
place (`load_weights`), and the engine drops the graphs when it frees the cache (`sleep`) and captures
them again on `wake`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.model import CausalLM
from hybridflow.engine.rollout.sampler import fused, sample
from hybridflow.engine.rollout.sequence import RunningBatch
from hybridflow.engine.rollout.types import SamplingParams

_Out = TypeVar("_Out")


def decode_forward(model: torch.nn.Module, kv: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, max_context: int, live: torch.Tensor | None = None,
                   rope_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per row. tokens/positions/slots [B] int64 (rows sorted by slot) -> logits [B, V] in the
    model's dtype (the sampler computes in fp32).

    max_context: an upper bound on any row's context length (the flash kernel's max_seqlen_k, and the
    width of the gathered cache on the SDPA path). live: [B] bool, the rows not finished (`AttnMeta.live`).
    rope_offsets: [B] int64 added to the positions for the rotary embedding alone (the cache positions stay);
    None: no offset.
    """
    starts = slots * kv.max_len
    meta = AttnMeta(write_index=starts + positions,
                    cu_seqlens=torch.cat([starts, starts[-1:] + kv.max_len]).to(torch.int32),
                    cu_seqlens_q=torch.arange(tokens.shape[0] + 1, dtype=torch.int32, device=tokens.device),
                    max_seqlen=max_context, context_lens=(positions + 1).to(torch.int32), slots=slots, live=live,
                    rope_offsets=rope_offsets)
    return model(tokens, positions if rope_offsets is None else positions + rope_offsets, meta, kv)


def sample_and_record(batch: RunningBatch, size: int, logits: torch.Tensor, params: SamplingParams,
                      generator: torch.Generator | None, exact: bool = False,
                      never: torch.Tensor | None = None) -> None:
    """Sample a token for the batch's rows [0, size) from logits [size, V] and record it. The fused
    sampler reads the batch's seed and inverse temperature and the seed advances on the device (so this
    is capturable); otherwise the torch sampler draws from `generator`. `exact`, `never`: see `sampler.sample`."""
    if fused(logits, params):
        tokens, logprobs = sample(logits, params, None, batch.seed, batch.inv_temp, exact, never)
        batch.seed.add_(1)
    else:
        tokens, logprobs = sample(logits, params, generator, exact=exact, never=never)
    batch.record(size, tokens, logprobs)


def bucket_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to 32, then multiples of 32, then max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    sizes += list(range(32, max_batch, 32)) + [max_batch]
    return sizes


class DecodeGraphs:
    """Decode captured per bucket over the batch's buffers (one memory pool for all graphs)."""

    def __init__(self, model: CausalLM, kv: KVCache, batch: RunningBatch, rope_offsets: bool = False,
                 never: torch.Tensor | None = None) -> None:
        """rope_offsets: the forward shifts the rotary positions by the batch's `rope_offsets`; never: see
        `sampler.sample` (both as the engine decodes eagerly: `RolloutEngine`)."""
        self.sizes, self.exact, self.never = bucket_sizes(batch.capacity), model.exact, never
        batch.clear()  # every row padding: the warm-up runs touch only the scratch slot and scratch row
        self.forwards: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.tails: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.forwards[size], self.logits[size] = _capture(pool, lambda: decode_forward(
                model, kv, batch.tokens[:size], batch.positions[:size], batch.slots[:size], kv.max_len,
                ~batch.done(size), batch.rope_offsets[:size] if rope_offsets else None))
            self.forwards[size].replay()  # real logits (of padding rows) for the sampler's warm-up
            for greedy in (False, True):
                params = SamplingParams(temperature=0.0 if greedy else 1.0)
                if fused(self.logits[size], params):
                    self.tails[size, greedy] = _capture(pool, lambda: sample_and_record(
                        batch, size, self.logits[size], params, None, self.exact, never))[0]
        batch.clear()
        torch.cuda.synchronize()

    def bucket(self, batch: int) -> int:
        """The captured size a step of `batch` rows replays."""
        return next(s for s in self.sizes if s >= batch)

    def step(self, batch: RunningBatch, params: SamplingParams, generator: torch.Generator | None) -> None:
        """One decode step of the batch's live rows: the bucket's forward graph, then its sampling graph
        (or, with top-k / top-p, the eager sampler on the forward's logits)."""
        size = self.bucket(len(batch))
        self.forwards[size].replay()
        tail = self.tails.get((size, params.greedy)) if fused(self.logits[size], params) else None
        if tail is not None:
            tail.replay()
        else:
            sample_and_record(batch, size, self.logits[size], params, generator, self.exact, self.never)


def _capture(pool, fn: Callable[[], _Out]) -> tuple[torch.cuda.CUDAGraph, _Out]:
    fn()  # warm-up: kernels chosen (and Triton compiled) and workspaces made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
