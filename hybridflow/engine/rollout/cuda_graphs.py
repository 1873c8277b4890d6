"""The decode step, eager or replayed from CUDA graphs captured at bucketed batch sizes.

`decode_forward` is the one definition of a decode step (build the attention metadata from the rows'
slots and positions, run the model, return fp32 logits); `DecodeGraphs` captures it at batch sizes
1, 2, 4, 8, 16, 32, then every 32 up to max_num_seqs, over static input buffers. A step of B rows
replays the smallest bucket >= B, its padding rows pointed at the KV cache's scratch slot. The graphs
hold raw pointers to the weights and the cache: weights are updated in place (`load_weights`), and the
engine drops the graphs when it frees the cache (`sleep`) and captures them again on `wake`.
"""

from __future__ import annotations

import torch

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.kv_cache import KVCache


def decode_forward(model: torch.nn.Module, kv: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, max_context: int) -> torch.Tensor:
    """One new token per row. tokens/positions/slots [B] int64 (rows sorted by slot) -> logits [B, V] in the
    model's dtype (the sampler computes in fp32).

    max_context: an upper bound on any row's context length (the flash kernel's max_seqlen_k, and the
    width of the gathered cache on the SDPA path).
    """
    starts = slots * kv.max_len
    meta = AttnMeta(write_index=starts + positions,
                    cu_seqlens=torch.cat([starts, starts[-1:] + kv.max_len]).to(torch.int32),
                    cu_seqlens_q=torch.arange(tokens.shape[0] + 1, dtype=torch.int32, device=tokens.device),
                    max_seqlen=max_context, context_lens=(positions + 1).to(torch.int32), slots=slots)
    return model(tokens, positions, meta, kv)


def bucket_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to 32, then multiples of 32, then max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    sizes += list(range(32, max_batch, 32)) + [max_batch]
    return sizes


class DecodeGraphs:
    """Decode captured per bucket over shared static buffers (one memory pool for all graphs)."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int) -> None:
        self.model, self.kv = model, kv
        self.sizes = bucket_sizes(max_batch)
        device = model.lm_head.weight.device
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), kv.scratch_slot, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: kernels chosen and workspaces made outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        return decode_forward(self.model, self.kv, self.tokens[:size], self.positions[:size],
                              self.slots[:size], self.kv.max_len)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Replay the smallest bucket holding B = len(tokens) rows; returns logits [B, V]."""
        batch = tokens.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        self.tokens[:batch].copy_(tokens)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(slots)
        if size > batch:
            self.tokens[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slots[batch:size].fill_(self.kv.scratch_slot)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
