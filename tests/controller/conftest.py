"""Module-scoped worker groups for the controller tests, on both backends (Ray when installed)."""

from __future__ import annotations

import os

import pytest

from hybridflow.controller import ResourcePool, WorkerGroup, colocate

from controller_workers import RefWorker, ToyWorker


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def backend(request):
    if request.param == "local":
        yield "local"
        return
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield "ray"
    ray.shutdown()


@pytest.fixture(scope="module")
def cpu_pool(backend):
    """Two CPU slots that every group of a module shares."""
    return ResourcePool(2, "cpu", name=f"test-{backend}")


@pytest.fixture(scope="module")
def group(backend, cpu_pool):
    """Two ranks, each one process holding a ToyWorker ("actor") and a RefWorker ("ref")."""
    cls = colocate(actor=ToyWorker, ref=RefWorker)
    init_kwargs = {"actor": {"hidden": 4}, "ref": {"scale": 2.0}}
    group = WorkerGroup(
        cls, 2, backend=backend, pool=cpu_pool, name="policy", init_kwargs=init_kwargs,
        env={"HYBRIDFLOW_TEST_ENV": "on"},
    )
    yield group
    group.shutdown()
