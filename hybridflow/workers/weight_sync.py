"""Sending the actor's weights to a rollout group on other devices, over torch.distributed.

The weight-sync group is a second process group, independent of each worker group's default one:
rank 0 is the actor group's rank 0 (the sender), ranks 1..R are the rollout group's ranks. The sender
hosts its store on its own node (`Rendezvous`, never on the controller's machine, which may be another
node of a Ray cluster); each member builds its `WeightChannel` from that store
(`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA, made directly from store, rank and size, so no
second default group is needed). At join time the sender publishes the bucket plan in the store: the HF
names and shapes of what each sync sends, in order (every parameter; with LoRA only the adapted modules'
merged weights, `TrainEngine.rollout_weight_shapes`), grouped into buckets of at most `bucket_bytes` in the
rollout dtype (a larger tensor gets a bucket of its own). Each sync then broadcasts one flat buffer per
bucket; a receiver turns it back into (name, view) pairs for `RolloutEngine.load_weights`, which
copies each view before the next bucket overwrites the buffer.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
TIMEOUT = timedelta(minutes=10)
_PLAN_KEY = "plan"

Plan = list[list[tuple[str, tuple[int, ...]]]]


class Rendezvous:
    """The store the members of one weight-sync group meet on, hosted by the sender at `host` (its node's
    address as the other members reach it) on a free port."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.port = self.store.port


def plan_buckets(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 bucket_bytes: int = BUCKET_BYTES) -> Plan:
    """Consecutive parameters grouped into buckets of at most `bucket_bytes` (a larger one alone)."""
    limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
    plan: Plan = []
    used = limit
    for name, shape in shapes:
        numel = math.prod(shape)
        if used + numel > limit:
            plan.append([])
            used = 0
        plan[-1].append((name, tuple(shape)))
        used += numel
    return plan


def _numel(bucket: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in bucket)


class WeightChannel:
    """One member's end of the weight-sync group: rank 0 sends, every other rank receives."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
        store = dist.PrefixStore("weight_sync", dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT))
        self.store, self.rank, self.device = store, rank, device
        self.group: Any  # a c10d backend (NCCL or gloo): its type stubs lack the `broadcast` both have
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        self.plan: Plan | None = None
        self.dtype: torch.dtype | None = None

    def publish_plan(self, plan: Plan, dtype: torch.dtype) -> None:
        """Sender: the bucket layout every sync follows (read by the receivers when they first receive)."""
        self.plan, self.dtype = plan, dtype
        # Store.set takes bytes as well as str (its type stub names only str)
        self.store.set(_PLAN_KEY, pickle.dumps((plan, dtype)))  # type: ignore[arg-type]

    def _load_plan(self) -> None:
        if self.plan is None:
            self.plan, self.dtype = pickle.loads(self.store.get(_PLAN_KEY))

    def _planned(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("weight sync: no bucket plan (the sender publishes it at join_weight_sync)")
        return self.plan

    def _buffer(self) -> torch.Tensor:
        return torch.empty(max(map(_numel, self._planned())), dtype=self.dtype, device=self.device)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Sender: packs the tensors (in plan order) into buckets and broadcasts each; returns the bucket count."""
        buffer, tensors, plan = self._buffer(), iter(named_tensors), self._planned()
        for bucket in plan:
            offset = 0
            for name, shape in bucket:
                got, tensor = next(tensors)
                if got != name or tuple(tensor.shape) != shape:
                    raise ValueError(f"weight sync: expected {name} {shape} (the plan made at join), got "
                                     f"{got} {tuple(tensor.shape)}; the model's parameters changed")
                buffer[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
                offset += tensor.numel()
            self.group.broadcast(buffer[:offset], 0).wait()
        return len(plan)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: (HF name, view into the bucket buffer) per parameter; consume each view before the next."""
        self._load_plan()
        buffer = self._buffer()
        for bucket in self._planned():
            self.group.broadcast(buffer[:_numel(bucket)], 0).wait()
            offset = 0
            for name, shape in bucket:
                numel = math.prod(shape)
                yield name, buffer[offset:offset + numel].view(shape)
                offset += numel


def drain(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """An actor rank other than the sender: takes part in each parameter's gather and drops the result."""
    return sum(1 for _ in named_tensors)
