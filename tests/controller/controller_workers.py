"""Small worker classes shared by the controller tests (importable by spawned and Ray workers)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, Worker, register


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def tiny_model(hidden: int) -> torch.nn.Linear:
    """The same seeded linear model in every process (and in the test, for expected values)."""
    gen = torch.Generator().manual_seed(1234)
    model = torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=gen))
        model.bias.copy_(torch.randn(model.bias.shape, generator=gen))
    return model


class ToyWorker(Worker):
    def __init__(self, hidden: int = 4) -> None:
        self.model = tiny_model(hidden)
        print(f"toy ready rank {self.rank}")

    @register(Dispatch.BROADCAST, collect="all")
    def info(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "device": str(self.device),
            "role": self.role,
            "dist_world": dist.get_world_size(self.process_group),
            "pid": os.getpid(),
            "env": os.environ.get("HYBRIDFLOW_TEST_ENV"),
        }

    @register(Dispatch.BROADCAST, collect="all")
    def environment(self) -> tuple[dict[str, str], int]:
        """This process's environment and its parent's pid."""
        return dict(os.environ), os.getppid()

    @register(Dispatch.BROADCAST)
    def allreduce_sum(self, x: float) -> float:
        t = torch.tensor([x * (self.rank + 1)])
        dist.all_reduce(t, group=self.process_group)
        return t.item()

    @register(Dispatch.DATA_PARALLEL)
    def score(self, batch: Batch) -> Batch:
        rows = torch.tensor([len(batch)])
        dist.all_reduce(rows, group=self.process_group)
        with torch.no_grad():
            score = self.model(batch["features"]).squeeze(-1)
        out = Batch(
            {"score": score, "rank": torch.full((len(batch),), self.rank)},
            {"uid": batch["uid"]},
            {"total_rows": int(rows)},
        )
        return out

    @register(Dispatch.DATA_PARALLEL, pad=True)
    def score_padded(self, batch: Batch) -> Batch:
        return self.score(batch)

    @register(Dispatch.DATA_PARALLEL)
    def row_count(self, batch: Batch, offset: int = 0) -> int:
        return len(batch) + offset

    @register(Dispatch.DATA_PARALLEL, collect="same")
    def total_rows(self, batch: Batch) -> dict[str, int]:
        """The same on every rank (reduced over them): one dict comes back."""
        rows = torch.tensor([len(batch)])
        dist.all_reduce(rows, group=self.process_group)
        return {"rows": int(rows)}

    @register(Dispatch.RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.rank

    @register(Dispatch.PER_RANK)
    def add_rank(self, x: int, y: int = 0) -> int:
        return x + y + 100 * self.rank

    @register(Dispatch.BROADCAST)
    def fail_on(self, rank: int, message: str) -> str:
        if self.rank == rank:
            raise ValueError(message)
        return "fine"

    @register(Dispatch.BROADCAST)
    def shout(self, text: str) -> bool:
        print(f"{text} (out)")
        print(f"{text} (err)", file=sys.stderr)
        return True

    @register(Dispatch.BROADCAST)
    def rendezvous(self, folder: str, mine: str, other: str, timeout: float = 60.0) -> str:
        """Marks `mine` as started, then waits until group `other` started too (proves overlap)."""
        base = Path(folder)
        (base / f"{mine}-{self.rank}").touch()
        deadline = time.monotonic() + timeout
        while not (base / f"{other}-{self.rank}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{other} never started while {mine} was running")
            time.sleep(0.02)
        return mine

    @register(Dispatch.BROADCAST)
    def block(self, seconds: float) -> None:
        time.sleep(seconds)

    def helper(self) -> None:
        """Not registered: must not be callable from the controller."""


class RefWorker(Worker):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    @register(Dispatch.DATA_PARALLEL)
    def log_probs(self, batch: Batch) -> Batch:
        return Batch({"ref": batch["features"].sum(-1) * self.scale})

    @register(Dispatch.BROADCAST, collect="all")
    def where(self) -> tuple:
        return (self.role, self.rank, str(self.device), os.getpid())


class BrokenInit(Worker):
    """Rank 1 fails to build while rank 0 waits for it in a collective."""

    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot load weights")
        dist.barrier(group=self.process_group)
