"""The memory cap of a run (`trainer.device_memory_gib`): the bytes a device's plan may use, the caching allocator
held to them in each process that plans a device, and the refusals of a cap the card cannot give or the weights
cannot fit in.

A capped run plans as if the card had `memory_cap` bytes (`gpu_memory_utilization` applies to a whole card
only: the cap is the budget) and its processes allocate as if it had: `torch.cuda.set_per_process_memory_fraction`
(cap / the card's total) makes the allocator raise `torch.OutOfMemoryError` past the cap, which the workers turn
into explained errors (`planning.reported_oom`). While the rollout engine's KV cache is mapped in CUDA virtual
memory (outside the allocator) the allocator gets the cap less the cache (`hold`, called by the rollout replica).
The CUDA context, the kernels its libraries load and the communication library's buffers lie outside the
allocator too, where no fraction holds them: a capped plan budgets the cap less `OUTSIDE_ALLOCATOR_BYTES` for them and
holds the allocator to that (`allocator_bytes`), so the process as a whole stays within the cap.
"""

from __future__ import annotations

import torch

from hybridflow.engine.budget.estimate import GIB, DeviceDemand

CAP_KEY = "trainer.device_memory_gib"
# What a CUDA process holds outside PyTorch's caching allocator: the CUDA context, the modules of cuBLAS / cuDNN /
# Triton / compiled kernels it loads, NCCL's buffers. Measured on one H100 at c5f14af: the 1.5B full-parameter run
# held to a 16 GiB cap reached 16.85 GiB of the device (bench/results/small_gpu_1.5b_h100_c5f14af.json), 0.85 GiB
# beyond the cap; rounded up to 1 GiB. bench/small_gpu.py records, per setting, the device's used memory once the
# context exists (`context_gib`, `torch.cuda.mem_get_info` before any tensor) and the device's peak beside the
# allocator's (`outside_allocator_gib`), so each GPU run checks this figure.
OUTSIDE_ALLOCATOR_BYTES = GIB


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _setting(cap: int) -> str:
    """`trainer.device_memory_gib=<its value>` from the cap's bytes."""
    return f"{CAP_KEY}={cap / GIB:.4g}"


def allocator_bytes(cap: int) -> int:
    """What PyTorch's allocator (and the KV cache mapped beside it) may use under a cap of `cap` bytes: the cap less
    what the process holds outside the allocator (`OUTSIDE_ALLOCATOR_BYTES`)."""
    return max(cap - OUTSIDE_ALLOCATOR_BYTES, 0)


def budget_bytes(demand: DeviceDemand, free: int, total: int) -> int:
    """What a device's plan may use: the cap less what lies outside the allocator, or `utilization` of the whole
    card (the context already exists when `free` is measured); never more than is free."""
    whole = demand.utilization * total if demand.memory_cap is None else allocator_bytes(demand.memory_cap)
    return int(min(whole, free))


def budget_source(demand: DeviceDemand, total: int) -> str:
    """The keys that set the budget, for the plan's refusals."""
    if demand.memory_cap is not None:
        return (f"{_setting(demand.memory_cap)} of the card's {_gib(total)}, less {_gib(OUTSIDE_ALLOCATOR_BYTES)} "
                f"for the CUDA context and libraries")
    return f"trainer.gpu_memory_utilization={demand.utilization} of {_gib(total)}"


def weights_floor(demand: DeviceDemand) -> tuple[float, str]:
    """(bytes, what) of the weights a device must hold at once whatever the plan chooses: each trained role's
    stored weights (while it updates, with any offload) and each frozen model's unless it can be offloaded."""
    w = demand.world_size
    parts = [(r.weight_bytes(w), f"{r.keys} ({r.shape.describe()})") for r in demand.trained]
    parts += [(f.idle_bytes(w), f"a frozen model ({f.shape.describe()})") for f in demand.frozen if not f.offload_key]
    if not parts and demand.rollout is not None:
        parts = [(float(demand.rollout.weight_bytes), f"the rollout engine ({demand.rollout.shape.describe()})")]
    total = sum(b for b, _ in parts)
    return total, ", ".join(what for _, what in parts)


def weights_problem(demand: DeviceDemand) -> str | None:
    """Why a cap is below the weights' own size (None if it is not), naming the keys that shrink them."""
    if demand.memory_cap is None:
        return None
    floor, what = weights_floor(demand)
    if floor <= allocator_bytes(demand.memory_cap):
        return None
    return (f"{_setting(demand.memory_cap)} is below the weights' own size: {what} hold {_gib(floor)} per "
            f"device, beside {_gib(OUTSIDE_ALLOCATOR_BYTES)} for the CUDA context and libraries; raise {CAP_KEY}, or shrink them: model.master_dtype=bf16 with actor.optimizer=adamw_8bit, "
            f"actor.lora.rank > 0 (with model.quantization=nf4: 4-bit frozen weights), more devices "
            f"(trainer.n_workers), or a smaller model")


def hold_allocator(demand: DeviceDemand, device: torch.device, total: int) -> str | None:
    """Holds this process's allocator on `device` to the cap less what lies outside it (`allocator_bytes`;
    idempotent: the colocated roles of one process share the device and the cap); a cap above the card is not held:
    the reason comes back instead (None when held or uncapped)."""
    if demand.memory_cap is None:
        return None
    if demand.memory_cap > total:
        return (f"{_setting(demand.memory_cap)} is above this card's {_gib(total)} ({device}); use at most "
                f"{total / GIB:.1f}, or null for the whole card")
    hold(device, allocator_bytes(demand.memory_cap), total)
    return None


def hold(device: torch.device, cap: int, total: int, outside: int = 0) -> None:
    """This process's allocator on a CUDA `device` held to `cap` bytes of the card's `total`, less `outside` bytes
    the process holds beyond the allocator (the rollout's KV cache in CUDA virtual memory, `engine/rollout/vmm.py`):
    the process as a whole then stays within the cap."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(max(cap - outside, 0) / total, device)
