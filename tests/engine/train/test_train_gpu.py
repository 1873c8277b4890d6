"""On a CUDA device: the fused log-prob head at the real 151,936-token vocabulary, inductor-compiled layers
under FSDP2, the memory options (8-bit AdamW with bf16 master weights, CPU-offloaded AdamW) in the engine."""

from __future__ import annotations


import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch

from hybridflow.controller.runtime import ensure_single_process_group
from hybridflow.engine.train import TrainEngine, token_log_probs

pytestmark = pytest.mark.gpu
VOCAB = 151936


@pytest.fixture
def nccl_rank():
    """The process's one-rank NCCL group (the one inline worker groups share, which an earlier test may
    have made already), so the engine shards with FSDP2 and bf16 mixed precision as on a real run."""
    torch.cuda.set_device(0)
    ensure_single_process_group("cuda")
    yield


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_head_at_real_vocabulary_matches_full_logits_in_a_fraction_of_the_memory(compiled):
    torch.manual_seed(0)
    n, h = 4096, 896
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(VOCAB, h, device="cuda") / h ** 0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, VOCAB, (n,), device="cuda")
    w = torch.randn(n, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent = token_log_probs(hidden, weight, targets, 0.9, True, compiled=compiled)
    ((logp + 0.1 * ent) * w).sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    got = (logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float())
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.T).float() / 0.9  # the plain head: bf16 matmul, fp32 softmax
    logp_all = logits.log_softmax(-1)
    ref_logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((ref_logp + 0.1 * ref_ent) * w).sum().backward()
    torch.testing.assert_close(got[0], ref_logp, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got[1], ref_ent, atol=2e-3, rtol=1e-3)
    for ours, ref in zip(got[2:], (hidden.grad.float(), weight.grad.float())):
        assert (ours - ref).norm() / ref.norm() < 1e-2
    full_logits = n * VOCAB * 4
    assert peak < full_logits / 2, (peak / 2**30, full_logits / 2**30)


def test_compiled_layers_under_fsdp2_equal_eager(tiny_qwen2, nccl_rank):
    batch = rl_batch(rows=8, prompt_width=16, response_width=24, seed=3)
    results = []
    for compiled in (False, True):
        engine = TrainEngine(model_cfg(tiny_qwen2, dtype="bf16", compile=compiled), optim_cfg(), head="lm")
        assert engine.compiled is compiled
        out, _ = engine.forward(batch, temperature=1.0, with_entropy=True, pack=True)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        grads = [p.grad.full_tensor().float() for p in engine.model.parameters()]
        results.append((out["log_probs"].float().cpu(), grads))
    (eager, eager_grads), (comp, comp_grads) = results
    torch.testing.assert_close(comp, eager, atol=5e-2, rtol=5e-2)  # bf16: fused kernels round differently
    for a, b in zip(comp_grads, eager_grads):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


@pytest.mark.parametrize("master,optimizer", [("fp32", "adamw_8bit"), ("bf16", "adamw_8bit"),
                                              ("fp32", "adamw_cpu_offload")])
def test_memory_optimizers_train_under_fsdp2(tiny_qwen2, nccl_rank, master, optimizer):
    """Every optimizer takes steps that lower a fixed batch's loss; with bf16 master weights an lr far below
    bf16's resolution still moves the weights (stochastic rounding)."""
    pytest.importorskip("torchao")
    batch = rl_batch(rows=4, prompt_width=8, response_width=8, seed=5)

    def loss_fn(out, mb, ctx):
        return -(out["log_probs"] * mb["response_mask"]).sum() / ctx.global_tokens, {}

    engine = TrainEngine(model_cfg(tiny_qwen2, dtype="bf16", master_dtype=master),
                         optim_cfg(optimizer=optimizer, lr=1e-2), head="lm")
    losses = [engine.train_step(batch, loss_fn)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    engine.offload()
    engine.onload()  # optimizer_offload's round trip: a host-resident state stays on the host
    devices = {t.device.type for s in engine.optimizer.state.values() for k, t in s.items() if k != "step"}
    assert devices == ({"cpu"} if optimizer == "adamw_cpu_offload" else {"cuda"})
    losses.append(engine.train_step(batch, loss_fn)["loss"])
    if master == "bf16":
        engine.optimizer.param_groups[0]["lr"].fill_(1e-6)
        before = [p.detach().clone() for p in engine.model.parameters()]
        engine.train_step(batch, loss_fn)
        moved = sum(int((a != p.detach()).sum()) for a, p in zip(before, engine.model.parameters()))
        assert moved > 0


def test_packed_attention_takes_fp32_query_and_key_under_autocast():
    """A bf16-autocast forward hands the attention fp32 q/k (fp32 rotary tables promote them) and bf16 v:
    flash refuses fp32, so they take autocast's dtype, and the result matches the per-row SDPA path."""
    from hybridflow.engine.train.attention import _looped_varlen, varlen_attention_forward

    torch.manual_seed(0)
    lens = [5, 17, 9]
    t, hq, hkv, d = sum(lens), 4, 2, 64
    q = torch.randn(1, hq, t, d, device="cuda")
    k = torch.randn(1, hkv, t, d, device="cuda")
    v = torch.randn(1, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 22, 31], device="cuda", dtype=torch.int32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=d ** -0.5,
                                          cu_seq_lens_q=cu, max_length_q=max(lens))
    assert out.dtype == torch.bfloat16 and out.shape == (1, t, hq, d)
    ref = _looped_varlen(*(x[0].transpose(0, 1).to(torch.bfloat16) for x in (q, k, v)), cu, d ** -0.5)
    torch.testing.assert_close(out[0].float(), ref.float(), atol=2e-2, rtol=2e-2)
    fp32 = (q, k, v.float())  # outside autocast fp32 takes the per-row path, not flash (which refuses it)
    out32, _ = varlen_attention_forward(torch.nn.Module(), *fp32, None, scaling=d ** -0.5, cu_seq_lens_q=cu,
                                        max_length_q=max(lens))
    ref32 = _looped_varlen(*(x[0].transpose(0, 1) for x in fp32), cu, d ** -0.5)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32[0], ref32)
