"""A controller driving two SPMD worker groups: the smallest complete hybridflow.controller program.

    python examples/worker_group.py --backend local     # spawned processes (the default)
    python examples/worker_group.py --backend ray       # Ray actors in a placement group

A "policy" group colocates a trainable linear model (actor) with a frozen copy (ref) in one process
per rank; a separate "scorer" group runs at the same time. Batches are split over the ranks
unevenly (7 rows over 2 workers), gradients are all-reduced inside the group, and the controller
only sees plain Python calls.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, colocate, register


def linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 1)


class Actor(Worker):
    def __init__(self, lr: float = 0.1) -> None:
        self.model = linear(0)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=lr)
        print(f"actor ready on {self.device}, rank {self.rank} of {self.world_size}")

    @register(Dispatch.DATA_PARALLEL)
    def train_step(self, batch: Batch) -> dict:
        """One data-parallel SGD step on this rank's rows: gradients summed over the group."""
        n_total = torch.tensor([len(batch)], dtype=torch.float32)
        dist.all_reduce(n_total, group=self.process_group)
        pred = self.model(batch["x"]).squeeze(-1)
        loss = ((pred - batch["y"]) ** 2).sum() / n_total
        self.optim.zero_grad()
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.process_group)
        self.optim.step()
        return {"rank": self.rank, "rows": len(batch), "loss_part": loss.item()}

    @register(Dispatch.DATA_PARALLEL, pad=True)
    def predict(self, batch: Batch) -> Batch:
        with torch.no_grad():
            return Batch({"pred": self.model(batch["x"]).squeeze(-1)})


class Reference(Worker):
    def __init__(self) -> None:
        self.model = linear(0)

    @register(Dispatch.DATA_PARALLEL)
    def predict(self, batch: Batch) -> Batch:
        with torch.no_grad():
            return Batch({"ref_pred": self.model(batch["x"]).squeeze(-1)})


class Scorer(Worker):
    @register(Dispatch.DATA_PARALLEL)
    def score(self, batch: Batch) -> Batch:
        return Batch({"target_norm": batch["y"].abs()}, {"scored_by": [f"rank {self.rank}"] * len(batch)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.backend == "ray":
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, generator=gen)
    data = Batch({"x": x, "y": x @ torch.tensor([1.0, -2.0, 0.5, 3.0])}, {"uid": [f"p{i}" for i in range(7)]})

    pool = ResourcePool(args.workers, "cpu", name="cpus")  # both groups share these CPU slots
    common = dict(n_workers=args.workers, backend=args.backend, pool=pool)
    policy = WorkerGroup(colocate(actor=Actor, ref=Reference), name="policy", **common)
    scorer = WorkerGroup(Scorer, name="scorer", **common)
    with policy, scorer:
        scored = scorer.score.submit(data)  # runs while the policy trains
        for step in range(3):
            parts = policy.actor.train_step(data)
            loss = sum(p["loss_part"] for p in parts)
            print(f"step {step}: loss {loss:.4f}, rows per rank {[p['rows'] for p in parts]}")
        out = policy.actor.predict(data).union(policy.ref.predict(data)).union(data).union(scored.result())
        print(out)
        print("actor - ref on the first rows:", (out["pred"] - out["ref_pred"])[:3].tolist())
        print("scored by:", list(out["scored_by"]))


if __name__ == "__main__":
    main()
