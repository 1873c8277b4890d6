"""Training steps of the engine on 2 gloo ranks against 1 process: gradient equality under data
parallelism and micro-batching (by count and by tokens), one global clip, non-finite steps skipped,
offload round trips, and gathered bf16 weights for a sync. One forked group runs every distributed
case (start-up costs the most)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from train_helpers import model_cfg, optim_cfg, rl_batch, run_ranks

from hybridflow.config.model_schema import FrozenModelConfig
from hybridflow.engine.train import TrainEngine

BETA1 = 0.9
ROWS = 5


def pg_loss(out, mb, ctx):
    """A token-mean surrogate whose share per micro-batch sums to the mini-batch loss."""
    mask = mb["response_mask"]
    loss = -(out["log_probs"] * mb["advantages"] * mask).sum() / ctx.global_tokens
    return loss, {"logp_mean": float((out["log_probs"].detach() * mask).sum() / mask.sum().clamp(min=1))}


def nan_loss(out, mb, ctx):
    loss, metrics = pg_loss(out, mb, ctx)
    return loss * float("nan"), metrics


def _batch():
    batch = rl_batch(rows=ROWS, prompt_width=6, response_width=7, seed=4)
    batch["advantages"] = torch.randn(ROWS, 7, generator=torch.Generator().manual_seed(5))
    return batch


def _first_moments(engine) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg after one step = (1 - beta1) * the applied (clipped) gradient, gathered."""
    out = {}
    for name, p in engine.model.named_parameters():
        m = engine.optimizer.state[p]["exp_avg"]
        m = m.full_tensor() if isinstance(m, DTensor) else m
        out[name] = (m / (1 - BETA1)).detach().clone()
    return out


def _full_params(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.iter_full_params()}


def _local_state(engine) -> list[torch.Tensor]:
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in engine.model.parameters()]
    for state in engine.optimizer.state.values():
        tensors += [v.to_local() if isinstance(v, DTensor) else v for k, v in state.items() if k != "step"]
    return [t.detach().clone() for t in tensors]


def _ranks(rank, path):
    batch = _batch()
    shard = [0, 1, 2] if rank == 0 else [3, 4]  # uneven shards: 3 rows and 2 rows
    local = {k: v[shard] for k, v in batch.items()}
    results = {}
    for name, kw in {"count": dict(micro_batch_size=2), "tokens": dict(max_tokens=14)}.items():
        engine = TrainEngine(model_cfg(path), optim_cfg(grad_clip=1e9), head="lm", pack_on_cpu=True)
        results["full_bf16"] = dict(engine.iter_full_params(torch.bfloat16))  # what a weight sync sends
        metrics = engine.train_step(local, pg_loss, **kw)
        results[name] = (_first_moments(engine), metrics["grad_norm"], metrics["loss"])
    engine = TrainEngine(model_cfg(path), optim_cfg(grad_clip=1e-3), head="lm", pack_on_cpu=True)
    metrics = engine.train_step(local, pg_loss, micro_batch_size=1)
    results["clipped"] = (_first_moments(engine), metrics["grad_norm"])
    before = _full_params(engine)
    metrics = engine.train_step(local, nan_loss, micro_batch_size=2)
    after = _full_params(engine)
    results["nan"] = (metrics["stepped"], engine.skipped_steps,
                      all(torch.equal(before[k], after[k]) for k in before))
    state = _local_state(engine)
    ptrs = [p.to_local().data_ptr() for p in engine.model.parameters()]
    engine.offload(params=True, optimizer=True)
    moved = all(p.to_local().data_ptr() != q for p, q in zip(engine.model.parameters(), ptrs))
    engine.onload(params=True, optimizer=True)
    same = all(torch.equal(a, b) for a, b in zip(state, _local_state(engine)))
    engine.train_step(local, pg_loss, micro_batch_size=2)  # FSDP still works on the moved storage
    results["offload"] = (moved, same, _full_params(engine))
    dist.barrier()
    return results


def test_data_parallel_micro_batched_step_matches_one_process(tiny_qwen2):
    batch = _batch()
    results = run_ranks(2, _ranks, str(tiny_qwen2))

    ref = TrainEngine(model_cfg(tiny_qwen2), optim_cfg(grad_clip=1e9), head="lm", pack_on_cpu=True)
    ref_metrics = ref.train_step(batch, pg_loss)
    ref_grads, ref_norm = _first_moments(ref), ref_metrics["grad_norm"]
    assert ref_norm > 1e-3

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen2).named_parameters())
    for rank_results in results:
        full = rank_results["full_bf16"]
        assert set(full) == set(initial)
        for name, t in full.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, initial[name].detach().to(torch.bfloat16)), name
        for mode in ("count", "tokens"):
            grads, norm, loss = rank_results[mode]
            assert abs(norm - ref_norm) < 1e-4 * ref_norm, mode
            assert abs(loss - ref_metrics["loss"]) < 1e-5, mode
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=f"{mode}: {name}")

        # one clip, on the global norm: every shard scaled by the same max_norm / global_norm
        grads, norm = rank_results["clipped"]
        assert abs(norm - ref_norm) < 1e-4 * ref_norm
        total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        assert abs(float(total) - 1e-3) < 1e-7
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g * (1e-3 / ref_norm), atol=1e-9, rtol=1e-4)

        stepped, skipped, unchanged = rank_results["nan"]
        assert stepped == 0.0 and skipped == 1 and unchanged

        moved, same, params_after = rank_results["offload"]
        assert moved and same
    for name in results[0]["offload"][2]:
        torch.testing.assert_close(results[0]["offload"][2][name], results[1]["offload"][2][name])


def _one_rank(rank, path):
    fp32 = TrainEngine(model_cfg(path), optim_cfg(), head="lm")
    bf16 = TrainEngine(model_cfg(path, dtype="bf16"), optim_cfg(), head="lm")
    return (sum(isinstance(p, DTensor) for p in fp32.model.parameters()),
            all(isinstance(p, DTensor) for p in bf16.model.parameters()),
            {n: t.clone() for n, t in bf16.iter_full_params(torch.bfloat16)}, _accumulation(path))


def _accumulation(path):
    """One bf16 rank's step in one forward and in 3 micro-batches: first moments, and whether the sharded
    gradients existed when each later micro-batch began (they must not: accumulated unsharded)."""
    moments, reduced_early = [], []
    for micro in (None, 2):
        engine = TrainEngine(model_cfg(path, dtype="bf16"), optim_cfg(), head="lm")
        shards = list(engine.model.parameters())  # during a forward the module holds the gathered ones

        def loss_fn(out, mb, ctx):
            reduced_early.append(any(p.grad is not None for p in shards))
            return pg_loss(out, mb, ctx)

        engine.train_step(_batch(), loss_fn, micro_batch_size=micro)
        moments.append(_first_moments(engine))
        engine.train_step(_batch(), pg_loss, micro_batch_size=micro)  # the state after a step trains again
    return moments, reduced_early


@pytest.fixture(scope="module")
def one_rank(tiny_qwen2):
    """`_one_rank`'s results, from one forked process for both tests below."""
    return run_ranks(1, _one_rank, str(tiny_qwen2))[0]


def test_one_rank_shards_only_for_mixed_precision_and_syncs_local_weights(one_rank, tiny_qwen2):
    """One rank in fp32: a plain module (FSDP2 would shard and cast nothing). One rank in bf16: FSDP2 for
    its mixed precision, and a weight sync hands over the local tensors, equal to the model's weights."""
    fp32_dtensors, bf16_sharded, full, _ = one_rank
    assert fp32_dtensors == 0 and bf16_sharded
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen2).named_parameters())
    assert set(full) == set(initial)
    for name, t in full.items():
        assert not isinstance(t, DTensor) and t.dtype == torch.bfloat16, name
        assert torch.equal(t, initial[name].detach().to(torch.bfloat16)), name


def test_one_rank_accumulates_micro_batches_unsharded(one_rank):
    """One sharded rank keeps fp32 gradients unsharded across a step's micro-batches (no per-micro-batch
    reduce-scatter) and the step's gradient equals the one-forward step's (to bf16 compute)."""
    (whole, micro), reduced_early = one_rank[3]
    assert reduced_early == [False, False, False, False]
    for name, m in whole.items():
        torch.testing.assert_close(micro[name], m, atol=2e-3, rtol=2e-2)


def test_a_frozen_engine_refuses_to_train(tiny_qwen2):
    """A frozen engine (no optimizer section) names why it cannot step, before any forward."""
    engine = TrainEngine(model_cfg(tiny_qwen2), None, head="lm")
    with pytest.raises(RuntimeError, match="frozen"):
        engine.train_step(_batch(), pg_loss, micro_batch_size=ROWS)
    with pytest.raises(RuntimeError, match="frozen"):
        engine.clip_and_step()


def test_a_model_config_without_a_path_is_refused():
    with pytest.raises(ValueError, match="model_cfg.path"):
        TrainEngine(FrozenModelConfig(), None, head="lm")
