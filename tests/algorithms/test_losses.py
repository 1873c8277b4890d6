"""Policy and value losses: hand-computed values, gradients (gradcheck / closed form), registry, errors."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    POLICY_LOSSES,
    cispo_policy_loss,
    compute_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
)

# four real tokens: clipped-high (A>0), clipped-low (A<0), inside the bounds, dual-clip capped (A<0)
RATIOS = [1.5, 0.5, 1.1, 4.0, 9.0]
ADV = torch.tensor([[1.0, -1.0, -2.0, -1.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
OLD = torch.full((1, 5), -1.0)
LOGP = OLD + torch.log(torch.tensor([RATIOS]))


def test_ppo_hand_computed():
    loss, metrics = ppo_policy_loss(OLD, LOGP, ADV, MASK, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # per token: max(-1.5, -1.28) = -1.28; max(0.5, 0.8) = 0.8; 2.2; min(3, max(4, 1.28)) = 3
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 2.2 + 3.0) / 4, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS[:4]) / 4, abs=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_ppo_gradient_is_zero_on_clipped_tokens():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(OLD, logp, ADV, MASK, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # only the in-bounds token moves: d(-A * ratio)/d logp = -A * ratio, over 4 tokens
    expected = torch.tensor([[0.0, 0.0, 2.0 * 1.1 / 4, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_ppo_log_ratio_is_clamped_and_clip_c_checked():
    loss, metrics = ppo_policy_loss(torch.zeros(1, 1), torch.full((1, 1), 50.0), torch.ones(1, 1), torch.ones(1, 1))
    assert torch.isfinite(loss) and metrics["ppo_kl"].item() == pytest.approx(-20.0)
    with pytest.raises(ValueError, match="clip_c"):
        ppo_policy_loss(OLD, LOGP, ADV, MASK, clip_c=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_policy_loss(OLD, LOGP, ADV[:, :3], MASK)


def _away_from_kinks(seed: int) -> tuple[torch.Tensor, ...]:
    """float64 inputs whose ratios sit at least 0.01 from every clip bound (finite differences stay smooth)."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(3, 4, generator=gen, dtype=torch.float64) - 2.0
    ratio = torch.tensor([[0.5, 0.9, 1.05, 1.5], [3.5, 1.1, 0.7, 1.0], [0.95, 5.0, 1.4, 0.6]], dtype=torch.float64)
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    return old, old + ratio.log(), adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_ppo_gradcheck(agg):
    old, logp, adv, mask = _away_from_kinks(0)
    logp.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: ppo_policy_loss(old, lp, adv, mask, 0.2, 0.28, 3.0, agg)[0], (logp,))


def test_gspo_hand_computed_and_gradient():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = gspo_policy_loss(old, logp, adv, mask, clip_low=0.1, clip_high=0.5)
    s0 = math.exp(0.2)  # row 0: exp(mean(0.1, 0.3)), inside [0.9, 1.5]; row 1: ratio 1
    assert loss.item() == pytest.approx((-s0 + 1.0) / 2, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    # each token gets -A * s_i / n_i / n_rows (the sequence ratio is carried with a stop-gradient)
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [1 / 3 / 2, 1 / 3 / 2, 1 / 3 / 2]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_gspo_clips_the_sequence_ratio():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.5]], requires_grad=True)
    loss, metrics = gspo_policy_loss(old, logp, torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_cispo_hand_computed_and_gradient():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = (old + torch.log(torch.tensor([[1.5, 1.0, 0.5]]))).requires_grad_(True)
    adv = torch.tensor([[2.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = cispo_policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    weights = [1.28, 1.0, 0.8]
    lp = logp.detach()[0].tolist()
    expected = sum(-w * a * x for w, a, x in zip(weights, adv[0].tolist(), lp)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # clipped tokens keep a gradient: -sg(w) * A / n
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 * 2 / 3, -1.0 / 3, 0.8 / 3]]), atol=1e-6)


def test_value_loss_hand_computed_and_gradcheck():
    vpreds = torch.tensor([[1.0, 0.1, 0.0, 5.0]])
    returns = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    old = torch.tensor([[0.2, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = value_loss(vpreds, returns, old, mask, clip_range=0.5)
    # token 0: max(1, 0.7^2) = 1; token 1: clipped to 0.5 -> max(0.01, 0.25) = 0.25; token 2: 1
    assert loss.item() == pytest.approx(0.5 * (1 + 0.25 + 1) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    gen = torch.Generator().manual_seed(3)
    v = torch.tensor([[0.3, -0.9, 1.7], [0.0, 2.2, -0.4]], dtype=torch.float64, requires_grad=True)
    ret = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    old_v = v.detach() + torch.tensor([[0.8, -0.1, 0.3], [-0.9, 0.2, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, ret, old_v, m, 0.5)[0], (v,))


def test_compute_policy_loss_by_name_and_option_filtering():
    old, logp, adv, mask = _away_from_kinks(1)
    cfg = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0, "agg": "token-mean"}
    assert torch.equal(compute_policy_loss("ppo", old, logp, adv, mask, **cfg)[0],
                       ppo_policy_loss(old, logp, adv, mask, 0.2, 0.28, 3.0, "token-mean")[0])
    assert get_policy_loss("vanilla") is ppo_policy_loss
    # gspo takes no clip_c / agg: they are left out, and it aggregates seq-mean-token-mean
    assert torch.equal(compute_policy_loss("gspo", old, logp, adv, mask, **cfg)[0],
                       gspo_policy_loss(old, logp, adv, mask, 0.2, 0.28)[0])
    assert torch.equal(compute_policy_loss("cispo", old, logp, adv, mask, **cfg)[0],
                       cispo_policy_loss(old, logp, adv, mask, 0.2, 0.28, "token-mean")[0])
    with pytest.raises(TypeError, match="Did you mean 'clip_high'"):
        compute_policy_loss("ppo", old, logp, adv, mask, clip_hgh=0.3)
    with pytest.raises(ValueError, match="Did you mean 'gspo'"):
        get_policy_loss("gpso")


def test_policy_loss_micro_batches_add_up_with_global_counts():
    old, logp, adv, mask = _away_from_kinks(2)
    for agg in ("token-mean", "seq-mean-token-mean"):
        whole = ppo_policy_loss(old, logp, adv, mask, agg=agg)[0]
        counts = {"global_token_count": mask.sum(), "global_seq_count": (mask.sum(-1) > 0).sum()}
        halves = sum(ppo_policy_loss(old[r], logp[r], adv[r], mask[r], agg=agg, **counts)[0]
                     for r in (slice(0, 1), slice(1, 3)))
        assert halves.item() == pytest.approx(whole.item(), abs=1e-12)


def test_register_custom_policy_loss():
    @register_policy_loss("test_reinforce")
    def reinforce(old_logp, logp, advantages, response_mask, scale: float = 1.0):
        loss = -(advantages * logp * response_mask).sum() / response_mask.sum() * scale
        return loss, {}

    try:
        old, logp, adv, mask = _away_from_kinks(4)
        loss, _ = compute_policy_loss("test_reinforce", old, logp, adv, mask, scale=2.0, clip_low=0.2)
        assert loss.item() == pytest.approx((-(adv * logp * mask).sum() / mask.sum() * 2).item())
    finally:
        POLICY_LOSSES.unregister("test_reinforce")
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_policy_loss("test_reinforce")
