"""DCP resharding both ways: a plain 1-process checkpoint loaded by 2 gloo FSDP2 ranks, and their
2-rank checkpoint (model + AdamW) loaded back into one plain process."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.checkpoint import CheckpointManager, load_worker_state, read_full_model_state, save_worker_state
from hybridflow.checkpoint.manager import read_manifest
from hybridflow.controller.backends.process_start import fork_server_context


def _full_state(model, optimizer) -> dict:
    """{"params": {name: full tensor}, "exp_avg": {name: full tensor}} of a plain or FSDP2 model."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()

    names = {param: name for name, param in model.named_parameters()}
    return {"params": {name: full(param) for name, param in model.named_parameters()},
            "exp_avg": {names[p]: full(s["exp_avg"]) for p, s in optimizer.state.items()}}


def _assert_same(got: dict, expected: dict) -> None:
    for kind in ("params", "exp_avg"):
        assert got[kind].keys() == expected[kind].keys(), kind
        for name, value in got[kind].items():
            assert torch.equal(value, expected[kind][name]), (kind, name)


def _fsdp_worker(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = AutoModelForCausalLM.from_pretrained(model_path)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_worker_state(f"{out}/one/actor", model, optimizer)  # resharding 1 -> 2
        _assert_same(_full_state(model, optimizer), torch.load(f"{out}/one_expected.pt"))
        torch.manual_seed(0)
        ids = torch.randint(4, 260, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        manager = CheckpointManager(out, keep=2, process_group=dist.group.WORLD)
        tmp = manager.begin(5)
        save_worker_state(tmp / "actor", model, optimizer, {"note": {"world": world}})
        manager.commit(5, tmp)
        expected = _full_state(model, optimizer)
        if rank == 0:
            torch.save({**expected, "draw": torch.rand(3)}, f"{out}/expected.pt")
        else:
            torch.rand(3)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_reshard_one_to_two_to_one(tmp_path, tiny_qwen2, trained):
    """1 plain process → 2 FSDP2 ranks (they check it), a collective begin/commit over the 2 ranks,
    then their checkpoint loaded by one plain process."""
    from transformers import AutoModelForCausalLM

    model, optimizer, _ = trained
    save_worker_state(tmp_path / "one" / "actor", model, optimizer)
    torch.save(_full_state(model, optimizer), tmp_path / "one_expected.pt")

    # fork: the children inherit the imported torch/transformers instead of importing them again (not once
    # CUDA is initialised in this process, as after the GPU tests: a forked CUDA context breaks; nor once an
    # inline worker group of an earlier test made this process's default process group, which a forked
    # child would inherit and then refuse to initialise again): then the local backend's clean fork server,
    # which has imported them too (a spawned child imported them again: ~10 s of this test in a full run)
    import torch.distributed as dist

    method = "fork"
    if torch.cuda.is_initialized() or dist.is_initialized():
        fork_server_context()
        method = "forkserver"
    context = mp.start_processes(_fsdp_worker, args=(2, str(tmp_path / "pg"), str(tiny_qwen2), str(tmp_path)),
                                 nprocs=2, start_method=method, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two FSDP2 ranks did not finish within 180 s")
    expected = torch.load(tmp_path / "expected.pt")
    checkpoint = CheckpointManager(tmp_path).latest()
    assert checkpoint.name == "step_00000005"
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]
    shards = sorted(p.name for p in (checkpoint / "actor" / "model").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    files = set(read_manifest(checkpoint)["files"])
    assert {"actor/rng_rank0.pt", "actor/rng_rank1.pt", "actor/state.pt"} <= files
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rest = load_worker_state(checkpoint / "actor", model, optimizer)

    assert rest == {"note": {"world": 2}}
    assert torch.equal(torch.rand(3), expected["draw"]), "rank 0's RNG state should be restored"
    _assert_same(_full_state(model, optimizer), expected)
    full = read_full_model_state(checkpoint / "actor")
    assert torch.equal(full["model.norm.weight"], expected["params"]["model.norm.weight"])
