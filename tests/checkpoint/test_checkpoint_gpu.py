"""On a CUDA device: CUDA RNG round trip, FSDP2 + bf16 mixed precision save/load, export of its weights."""

from __future__ import annotations

import pytest
import torch

from hybridflow.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    export_hf,
    load_worker_state,
    restore_rng_state,
    save_hf_assets,
    save_worker_state,
)

pytestmark = pytest.mark.gpu


def test_cuda_rng_round_trip():
    torch.cuda.init()
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(123)
    restore_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def _sharded(model_path, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_fsdp2_bf16_save_load_export(tmp_path, tiny_qwen2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        model, optimizer = _sharded(tiny_qwen2, mesh)
        ids = torch.randint(4, 260, (2, 12), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        manager = CheckpointManager(tmp_path / "run", process_group=dist.group.WORLD)
        tmp = manager.begin(1)
        save_worker_state(tmp / "actor", model, optimizer)
        save_hf_assets(tmp / "actor", tiny_qwen2)
        checkpoint = manager.commit(1, tmp)
        expected_draw = torch.rand(3, device="cuda")

        fresh, fresh_optimizer = _sharded(tiny_qwen2, mesh)
        load_worker_state(checkpoint / "actor", fresh, fresh_optimizer)
        assert torch.equal(torch.rand(3, device="cuda"), expected_draw)
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), name
        full = {name: p.full_tensor().float().cpu() for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()

    exported = AutoModelForCausalLM.from_pretrained(export_hf(checkpoint, tmp_path / "hf"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    reference.load_state_dict(full, strict=False)
    cpu_ids = ids.cpu()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=cpu_ids).logits, reference(input_ids=cpu_ids).logits,
                                   atol=1e-5, rtol=0)
