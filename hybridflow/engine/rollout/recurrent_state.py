"""The cache of a hybrid model (Qwen3.5): the K/V of its full-attention layers and, beside them, the per-slot states
of its linear-attention layers.

A sequence's slot holds, for every Gated DeltaNet layer, its short-conv state (the conv's last W inputs, [C, W] in
the model dtype) and its recurrent state ([HV, K, V] fp32), plus `lengths[slot]`: how many of the sequence's tokens
the states have taken in. Unlike K/V, a state cannot be re-read at an earlier position, so:

- a new prompt's prefill starts from zero states and overwrites its slots' states (a reused slot is reset);
- a decode step folds a row's token in only while the row is live: a finished row keeps being fed its last token
  until the host looks (`RunningBatch.record`), which rewrites the same K/V position but would fold the token in
  again;
- a continuation must start where the states are (`lengths`): a sequence cut short (`Session.shorten`) cannot be
  continued, and says so.

The states count in the cache budget (`KVCache`'s `state_bytes`) and are freed and re-made with the K/V; they are
ordinary allocations, so the engine captures its CUDA graphs again after a sleep (`keeps_address` is False).
"""

from __future__ import annotations

import torch

from hybridflow.engine.rollout.kv_cache import KVCache


class StateCache(KVCache):
    """K/V for `attention_layers`, conv and recurrent states for `linear_layers`, per slot (plus the scratch slot).

    conv_shape: (C, W) of one layer's conv state; state_shape: (HV, K, V) of its recurrent state.
    """

    def __init__(self, attention_layers: int, linear_layers: int, kv_heads: int, head_dim: int,
                 conv_shape: tuple[int, int], state_shape: tuple[int, int, int], max_len: int, max_num_seqs: int,
                 budget_bytes: int | None, dtype: torch.dtype, device: torch.device) -> None:
        self.linear_layers, self.conv_shape, self.state_shape = linear_layers, conv_shape, state_shape
        conv_bytes = conv_shape[0] * conv_shape[1] * torch.empty((), dtype=dtype).element_size()
        state_bytes = state_shape[0] * state_shape[1] * state_shape[2] * 4
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        super().__init__(attention_layers, kv_heads, head_dim, max_len, max_num_seqs, budget_bytes, dtype, device,
                         linear_layers * (conv_bytes + state_bytes))

    @property
    def keeps_address(self) -> bool:
        return False

    def allocate(self) -> None:
        super().allocate()
        if self.conv is None:
            slots = self.num_slots + 1
            self.conv = torch.zeros(self.linear_layers, slots, *self.conv_shape, dtype=self.dtype, device=self.device)
            self.recurrent = torch.zeros(self.linear_layers, slots, *self.state_shape, dtype=torch.float32,
                                         device=self.device)
            self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)

    def free(self) -> None:
        super().free()
        self.conv = self.recurrent = self.lengths = None

    def states(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Linear layer i's (conv [slots + 1, C, W], recurrent [slots + 1, HV, K, V]) and the slots' lengths."""
        conv, recurrent, lengths = self.conv, self.recurrent, self.lengths
        if conv is None or recurrent is None or lengths is None:
            raise RuntimeError("the state cache is freed (the engine is asleep); call engine.wake() first")
        return conv[i], recurrent[i], lengths
