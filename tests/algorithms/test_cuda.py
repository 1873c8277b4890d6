"""On a GPU, every algorithm function gives the CPU's numbers (to 1e-5) with inputs on the device."""

from __future__ import annotations

import pytest
import torch

import hybridflow.algorithms as A


def _all_outputs(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 0, 5, 1, 7, 4, 2])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    rewards = torch.randn(8, 7, generator=gen) * mask
    values, old, adv = (torch.randn(8, 7, generator=gen) for _ in range(3))
    logp = old + 0.3 * torch.randn(8, 7, generator=gen)
    ids = ["a", "a", "b", "b", "c", "d", "d", "d"]
    t = {k: v.to(device) for k, v in dict(r=rewards, m=mask, v=values, old=old, logp=logp, adv=adv).items()}
    r, m, v = t["r"], t["m"], t["v"]
    out = [*A.gae(r, v, m, 0.99, 0.95), *A.grpo(r, m, ids), *A.rloo(r, m, ids), *A.reinforce_plus_plus(r, m, 0.9),
           *A.reinforce_plus_plus_baseline(r, m, ids), *A.remax(r, m, v[:, 0])]
    for mode in A.AGG_MODES:
        out.append(A.aggregate(v, m, mode, global_token_count=m.sum(), global_seq_count=6))
        out += [A.ppo_policy_loss(t["old"], t["logp"], t["adv"], m, agg=mode)[0],
                A.cispo_policy_loss(t["old"], t["logp"], t["adv"], m, agg=mode)[0],
                A.value_loss(t["logp"], r, v, m, agg=mode)[0]]
    loss, metrics = A.gspo_policy_loss(t["old"], t["logp"], t["adv"], m, 0.1, 0.2)
    out += [loss, *metrics.values()]
    out += [A.kl_estimate(t["logp"], t["old"], kind) for kind in A.KL_KINDS]
    out += [A.kl_penalty_rewards(r, t["logp"], t["old"], m, 0.1, "k3"), A.mean_kl(t["logp"], t["old"], m)]
    out += [A.filter_groups(r.sum(-1), ids), A.overlong_penalty(torch.tensor([1, 5, 9], device=device), 8, 4)]
    return out


@pytest.mark.gpu
def test_cuda_matches_cpu():
    cpu, cuda = _all_outputs("cpu"), _all_outputs("cuda")
    for i, (a, b) in enumerate(zip(cpu, cuda)):
        assert b.device.type == "cuda", i
        assert torch.allclose(a.double(), b.cpu().double(), atol=1e-5), i
