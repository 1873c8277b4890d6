"""KL estimators, KL in reward, and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
    make_kl_controller,
    mean_kl,
)

LOGP = torch.log(torch.tensor([[0.5, 0.25]]))
REF = torch.log(torch.tensor([[0.25, 0.5]]))
L2 = math.log(2.0)


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [L2, -L2]),
        (("abs",), [L2, L2]),
        (("k2", "mse"), [0.5 * L2**2, 0.5 * L2**2]),
        # exp(ref - logp) - (ref - logp) - 1: row 0 has ref - logp = -log 2, row 1 +log 2
        (("k3", "low_var_kl"), [0.5 + L2 - 1, 2 - L2 - 1]),
    ],
)
def test_estimators_hand_computed(kinds, expected):
    for kind in kinds:
        assert torch.allclose(kl_estimate(LOGP, REF, kind), torch.tensor([expected]), atol=1e-6)


def test_k3_clamps():
    logp = torch.tensor([[30.0, -30.0, 0.0]])
    out = kl_estimate(logp, torch.zeros(1, 3), "k3")
    assert out.tolist() == [[10.0, 10.0, 0.0]]


@pytest.mark.parametrize("kind", KL_KINDS)
def test_estimators_gradcheck(kind):
    logp = torch.tensor([[-1.0, -0.3, -2.2]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.4, -0.1, -1.5]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, kind), (logp,))


def test_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="Did you mean 'low_var_kl'"):
        kl_estimate(LOGP, REF, "low_var")
    with pytest.raises(ValueError, match="ref_logp has shape"):
        kl_estimate(LOGP, REF[:, :1], "k1")


def test_kl_penalty_rewards_and_mean_kl():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-1.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = kl_penalty_rewards(scores, logp, ref, mask, coef=0.1, kind="k1")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.05, 1.0], [0.1, 2.1, 0.0]]))
    # row means of the masked k1: row 0 (0.5 - 0.5 + 0) / 3 = 0, row 1 (-1 - 1) / 2 = -1
    assert mean_kl(logp, ref, mask, "k1").item() == pytest.approx(-0.5)
    assert kl_loss(logp, ref, mask, "k1", "token-mean").item() == pytest.approx(-2.0 / 5)


def test_fixed_controller():
    ctl = make_kl_controller("fixed", coef=0.05)
    ctl.update(current_kl=100.0, n_steps=64)
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.05


def test_adaptive_controller_hand_computed_and_state():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1
    expected = 0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000)
    assert ctl.value == pytest.approx(expected)
    resumed = make_kl_controller("adaptive", coef=1.0, target=1.0, horizon=1.0)
    resumed.load_state_dict(ctl.state_dict())
    assert (resumed.value, resumed.target, resumed.horizon) == (ctl.value, 6.0, 10000.0)


def test_controller_errors():
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, target=6.0, horizon=0)
    with pytest.raises(ValueError, match="needs target and horizon"):
        make_kl_controller("adaptive", coef=0.1)
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_kl_controller("pid", coef=0.1)


def test_distillation_advantage_is_the_negated_weighted_reverse_kl_on_real_tokens():
    from hybridflow.algorithms import distillation_advantages

    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-3.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert distillation_advantages(logp, teacher, mask, coef=0.5).tolist() == [[-1.0, 0.5, 0.0]]
    with pytest.raises(ValueError, match="teacher_logp has shape"):
        distillation_advantages(logp, teacher[:, :2], mask)
