"""GPU worker groups (local backend): NCCL inside the group, `cuda:<local_rank>` devices, results
back on the CPU, GPU pools that refuse more GPUs than the machine has."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register

pytestmark = pytest.mark.gpu


class CudaWorker(Worker):
    def __init__(self) -> None:
        self.weight = torch.arange(4, dtype=torch.float32, device=self.device)

    @register(Dispatch.BROADCAST, collect="all")
    def where(self) -> dict:
        t = torch.ones(1, device=self.device) * (self.rank + 1)
        dist.all_reduce(t, group=self.process_group)
        return {
            "device": str(self.device),
            "current": torch.cuda.current_device(),
            "uuid": str(torch.cuda.get_device_properties(self.device).uuid),
            "sum": t.item(),
            "backend": str(dist.get_backend(self.process_group)),
        }

    @register(Dispatch.DATA_PARALLEL, pad=True)
    def project(self, batch: Batch) -> Batch:
        x = batch["x"].to(self.device)
        return Batch({"y": x @ self.weight, "on": torch.full((len(batch),), self.rank, device=self.device)})


@pytest.mark.parametrize("inline", [True, False])
def test_cuda_group_runs_nccl_and_returns_cpu_batches(inline):
    n = torch.cuda.device_count() if not inline else 1
    with WorkerGroup(CudaWorker, n, device="cuda", name="gpu", inline=inline) as group:
        info = group.where()
        assert [i["device"] for i in info] == [f"cuda:{r}" for r in range(n)]
        assert [i["current"] for i in info] == list(range(n))
        assert len({i["uuid"] for i in info}) == n
        assert all(i["sum"] == n * (n + 1) / 2 for i in info)
        x = torch.randn(7, 4)
        out = group.project(Batch({"x": x}))
        assert out["y"].device.type == "cpu" and len(out) == 7
        torch.testing.assert_close(out["y"], x @ torch.arange(4, dtype=torch.float32))


def test_gpu_pools_claim_distinct_gpus_and_refuse_too_many():
    count = torch.cuda.device_count()
    first = WorkerGroup(CudaWorker, 1, device="cuda", name="first", inline=False)
    try:
        with pytest.raises(ValueError, match=rf"needs {count} GPU\(s\) but this machine has {count}.*held by other pools"):
            WorkerGroup(CudaWorker, count, device="cuda", name="second")
        if count > 1:
            with WorkerGroup(CudaWorker, 1, device="cuda", name="second", inline=False) as second:
                assert first.where()[0]["uuid"] != second.where()[0]["uuid"]
    finally:
        first.shutdown()
    pool = ResourcePool(1, "cuda", name="solo")
    with WorkerGroup(CudaWorker, 1, pool=pool, name="a", inline=False):
        with pytest.raises(ValueError, match="GPUs are not shared between groups"):
            WorkerGroup(CudaWorker, 1, pool=pool, name="b")
