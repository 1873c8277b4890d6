"""The KV cache: one allocation, sized from a memory budget, in a slot layout.

Layout: `k` and `v` are each `[layers, slots + 1, max_len, kv_heads, head_dim]`. A running sequence owns
one slot (its row of `max_len` positions) for its whole life, so decode attention reads a contiguous
prefix of the row and a finished sequence frees its slot at once. The extra last slot is scratch: the
padding rows of a CUDA-graph bucket write there, so they never touch a live sequence.

`free()` gives the memory back (the engine's `sleep`); `allocate()` re-makes the tensors at the same
size. On a GPU with virtual memory management the cache lives in a `StableBuffer` (vmm.py), so it comes
back at the same addresses and the decode CUDA graphs captured over it stay valid (`keeps_address`);
elsewhere the tensors are ordinary allocations and land wherever the allocator puts them. Its size in a
training run comes from the device plan (`hybridflow.engine.budget`), passed in as bytes.
"""

from __future__ import annotations

import torch

from hybridflow.engine.budget import device_memory
from hybridflow.engine.rollout.vmm import StableBuffer


def resolve_budget(kv_cache_memory: float | int | None, device: torch.device) -> int | None:
    """Bytes the cache may take. None: no explicit budget (the slot count alone decides, capped at 90 %
    of free memory). A float in (0, 1]: that fraction of the device's free memory. An int: bytes."""
    if kv_cache_memory is None:
        return None
    if isinstance(kv_cache_memory, float):
        if not 0.0 < kv_cache_memory <= 1.0:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} is invalid; a float must be a fraction "
                             f"of free memory in (0, 1], or pass an int number of bytes")
        return int(kv_cache_memory * free_memory(device))
    if isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
        return kv_cache_memory
    raise ValueError(f"kv_cache_memory={kv_cache_memory!r} is invalid; valid: None, a fraction in (0, 1], "
                     f"or a positive int number of bytes")


def free_memory(device: torch.device) -> int:
    """Free bytes on `device` (an accelerator: the device budget's count; CPU: available system memory)."""
    memory = device_memory(device)
    if memory is not None:
        return memory[0]
    import psutil

    return psutil.virtual_memory().available


class KVCache:
    """Slot-layout K/V storage for all layers.

    num_slots: sequences that can run at once (plus one scratch slot); max_len: positions per slot;
    token_bytes: one cached position's keys and values over all layers (what attention reads per context token).
    state_bytes: what else a slot holds beside its K/V (a hybrid model's recurrent states: `recurrent_state.py`),
    counted in the budget; `bytes` is the K/V's alone (what `StableBuffer` holds), plus the states' in a subclass.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, max_num_seqs: int,
                 budget_bytes: int | None, dtype: torch.dtype, device: torch.device, state_bytes: int = 0) -> None:
        self.shape_tail = (max_len, kv_heads, head_dim)
        self.layers, self.max_len, self.dtype, self.device = layers, max_len, dtype, device
        kv_bytes = 2 * layers * max_len * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        per_slot = kv_bytes + state_bytes
        budget = budget_bytes if budget_bytes is not None else int(0.9 * free_memory(device))
        fit = budget // per_slot - 1
        if fit < 1:
            raise ValueError(f"the KV cache budget of {budget / 2**20:.1f} MiB holds no sequence: one slot "
                             f"of max_model_len={max_len} takes {per_slot / 2**20:.2f} MiB; raise "
                             f"kv_cache_memory or lower max_model_len")
        self.num_slots = min(max_num_seqs, fit)
        self.token_bytes, self.state_bytes = kv_bytes // max_len, state_bytes
        self.kv_bytes = kv_bytes * (self.num_slots + 1)  # K and V of every slot: the stable buffer, when there is one
        self.bytes = per_slot * (self.num_slots + 1)  # with the states beside them (`recurrent_state`), allocated apart
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._buffer = StableBuffer(self.kv_bytes, device) if StableBuffer.supported(device) else None
        self.allocate()

    @property
    def keeps_address(self) -> bool:
        """True when `free()` + `allocate()` give the tensors their old addresses back."""
        return self._buffer is not None

    @property
    def mapped_bytes(self) -> int:
        """What the cache maps outside PyTorch's allocator while allocated: its K/V in the stable buffer (CUDA virtual
        memory; a hybrid model's states are ordinary allocations), 0 without one."""
        return self.kv_bytes if self._buffer is not None else 0

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def allocate(self) -> None:
        """(Re-)make the K/V tensors, zero-filled: the padded decode path (CPU) reads positions past a
        row's length under a mask, and a softmax weight of 0 times a NaN left in fresh memory is NaN."""
        if self.k is not None:
            return
        shape = (self.layers, self.num_slots + 1, *self.shape_tail)
        if self._buffer is None:
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            return
        try:
            self._buffer.map()
        except RuntimeError:  # the memory may sit in the caching allocator's pool: hand it back, retry
            torch.cuda.empty_cache()
            self._buffer.map()
        half = self.kv_bytes // 2
        raw = self._buffer.tensor
        self.k, self.v = (raw[i * half:(i + 1) * half].view(self.dtype).view(shape) for i in range(2))
        raw[:self.kv_bytes].zero_()

    def free(self) -> None:
        self.k = self.v = None
        if self._buffer is not None:
            self._buffer.unmap()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (k, v), each [slots + 1, max_len, kv_heads, head_dim]."""
        k, v = self.k, self.v
        if k is None or v is None:
            raise RuntimeError("the KV cache is freed (the engine is asleep); call engine.wake() first")
        return k[i], v[i]
