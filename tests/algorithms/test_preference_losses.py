"""Preference losses against TRL's own code on fixed tensors (within 1e-6), plus the registry and input checks.

TRL computes its losses inside its trainers, so each parity test builds the trainer class without its
`__init__` (`Trainer.__new__`), sets the attributes the loss code reads, and calls TRL's method: DPO and IPO
through `DPOTrainer.compute_loss` with a model double that returns fixed per-token log-probs (the fields of
TRL's fused-head output), SimPO through `CPOTrainer.cpo_loss`, ORPO's odds-ratio term through
`ORPOTrainer.odds_ratio_loss`, the Bradley–Terry loss through `RewardTrainer.compute_loss`.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algorithms import (
    PREFERENCE_LOSSES,
    PreferenceOut,
    bradley_terry_loss,
    compute_preference_loss,
    preference_needs_reference,
    register_preference_loss,
)

trl = pytest.importorskip("trl")

PAIRS, WIDTH = 6, 9
TOL = dict(rel=0, abs=1e-6)


def _pairs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-token log-probs `[2P, W-1]` (chosen rows, then rejected rows, as TRL lays a batch out) with a
    completion mask of 1 to W-2 tokens after a one-token prompt, and reference log-probs per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH - 1, (2 * PAIRS,), generator=g)
    completion_mask = torch.zeros(2 * PAIRS, WIDTH, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        completion_mask[i, 1:1 + n] = 1
    token_logps = -torch.rand(2 * PAIRS, WIDTH - 1, generator=g, dtype=torch.float64) * 3
    token_logps = token_logps * completion_mask[:, 1:]
    ref_logps = token_logps.sum(-1) + torch.randn(2 * PAIRS, generator=g, dtype=torch.float64)
    return {"completion_mask": completion_mask, "token_logps": token_logps, "ref_logps": ref_logps}


def _ours(data: dict[str, torch.Tensor], name: str, **options) -> PreferenceOut:
    sums = data["token_logps"].sum(-1)
    tokens = data["completion_mask"].sum(-1).to(sums.dtype)
    chosen, rejected = sums.chunk(2)
    n_chosen, n_rejected = tokens.chunk(2)
    ref_chosen, ref_rejected = data["ref_logps"].chunk(2)
    return compute_preference_loss(name, chosen, rejected, n_chosen, n_rejected, ref_chosen_logps=ref_chosen,
                                   ref_rejected_logps=ref_rejected, **options)


def _identity_accelerator() -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


class FusedHeadModelDouble:
    """What TRL's DPO trainer calls as `model(**inputs, labels=..., fused_lm_head=True)`: an output with
    per-token `log_probs` (0 where the label is masked), `entropy`, `mean_logits` and `is_top1`."""

    training = True

    def __init__(self, token_logps: torch.Tensor) -> None:
        self.token_logps = token_logps

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache=False):
        zeros = torch.zeros_like(self.token_logps)
        return SimpleNamespace(log_probs=self.token_logps, entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool())


def _trl_dpo(data: dict[str, torch.Tensor], loss_type: str, beta: float) -> tuple[float, dict[str, float]]:
    from trl import DPOTrainer

    trainer = DPOTrainer.__new__(DPOTrainer)
    model = FusedHeadModelDouble(data["token_logps"])
    attrs = dict(model=model, accelerator=_identity_accelerator(), beta=beta, loss_types=[loss_type],
                 loss_weights=[1.0], ld_alpha=None, f_divergence_type="reverse_kl", precompute_ref_logps=True,
                 use_weighting=False, aux_loss_enabled=False, label_smoothing=0.0, ref_model=None,
                 _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trainer.__dict__.update(attrs)
    ref_chosen, ref_rejected = data["ref_logps"].chunk(2)
    mask = data["completion_mask"]
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = trainer.compute_loss(model, inputs)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_and_ipo_equal_trl(loss_type, beta):
    data = _pairs(seed=int(beta * 10))
    ours = _ours(data, loss_type, beta=beta)
    loss, metrics = _trl_dpo(data, loss_type, beta)
    assert float(ours.losses.mean()) == pytest.approx(loss, **TOL)
    assert float(ours.chosen_rewards.mean()) == pytest.approx(metrics["rewards/chosen"], **TOL)
    assert float(ours.rejected_rewards.mean()) == pytest.approx(metrics["rewards/rejected"], **TOL)
    margin = ours.chosen_rewards - ours.rejected_rewards
    assert float(margin.mean()) == pytest.approx(metrics["rewards/margins"], **TOL)
    assert float((margin > 0).double().mean()) == pytest.approx(metrics["rewards/accuracies"], **TOL)


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.4)])
def test_simpo_equals_trl(beta, gamma):
    from trl.experimental.cpo import CPOTrainer

    data = _pairs(seed=3)
    ours = _ours(data, "simpo", beta=beta, simpo_gamma=gamma)
    trainer = CPOTrainer.__new__(CPOTrainer)
    trainer.__dict__.update(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                            accelerator=_identity_accelerator())
    mean_logps = data["token_logps"].sum(-1) / data["completion_mask"].sum(-1)  # TRL's average_log_prob
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(*mean_logps.chunk(2))
    torch.testing.assert_close(ours.losses, losses, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards, rtol=0, atol=1e-6)


def test_orpo_equals_trl():
    from trl.experimental.orpo import ORPOTrainer

    data = _pairs(seed=4)
    beta = 0.25
    ours = _ours(data, "orpo", beta=beta)
    trainer = ORPOTrainer.__new__(ORPOTrainer)
    trainer.__dict__.update(beta=beta, accelerator=_identity_accelerator())
    mean_logps = data["token_logps"].sum(-1) / data["completion_mask"].sum(-1)
    chosen, rejected = mean_logps.chunk(2)
    losses, chosen_rewards, rejected_rewards, _, _ = trainer.odds_ratio_loss(chosen, rejected)
    # TRL's loss is the chosen NLL minus the mean of `losses`; ours keeps the NLL per pair (the chosen side's
    # mean NLL per completion token), so each pair's loss is -mean log-prob(chosen) - TRL's odds-ratio term
    torch.testing.assert_close(ours.losses, (-chosen - losses.double()), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_equals_trl(center):
    from trl.trainer.reward_trainer import RewardTrainer

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2 * PAIRS, 1, generator=g, dtype=torch.float64) * 2

    class SequenceClassifierDouble:  # TRL calls model(**inputs) and reads `.logits` [2P, 1]
        training = True

        def __call__(self, **inputs):
            return SimpleNamespace(logits=scores)

    trainer = RewardTrainer.__new__(RewardTrainer)
    model = SequenceClassifierDouble()
    trainer.__dict__.update(model=model, accelerator=_identity_accelerator(), _tp_size=1, _total_train_tokens=0,
                            args=SimpleNamespace(center_rewards_coefficient=center),
                            _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    loss = trainer.compute_loss(model, {"attention_mask": torch.ones(2 * PAIRS, 3, dtype=torch.long)})
    chosen, rejected = scores.squeeze(-1).chunk(2)
    ours = bradley_terry_loss(chosen, rejected, center_coef=center or 0.0)
    assert float(ours.mean()) == pytest.approx(float(loss), **TOL)
    assert float((chosen > rejected).double().mean()) == pytest.approx(trainer._metrics["train"]["accuracy"][-1])


def test_at_the_reference_dpo_is_log_2_and_rewards_are_zero():
    logps = torch.tensor([-5.0, -7.0])
    out = compute_preference_loss("sigmoid", logps, logps - 1, torch.ones(2), torch.ones(2), ref_chosen_logps=logps,
                                  ref_rejected_logps=logps - 1, beta=0.1)
    torch.testing.assert_close(out.losses, torch.full((2,), 0.6931471805599453))
    assert out.chosen_rewards.abs().max() == 0 and out.rejected_rewards.abs().max() == 0


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-4.0], requires_grad=True)
    rejected = torch.tensor([-4.0], requires_grad=True)
    out = compute_preference_loss("sigmoid", chosen, rejected, torch.ones(1), torch.ones(1),
                                  ref_chosen_logps=torch.tensor([-4.0]), ref_rejected_logps=torch.tensor([-4.0]))
    out.losses.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # descent raises chosen, lowers rejected


def test_reference_need_follows_the_signature():
    assert preference_needs_reference("sigmoid") and preference_needs_reference("ipo")
    assert not preference_needs_reference("simpo") and not preference_needs_reference("orpo")

    @register_preference_loss("test_hinge")
    def hinge(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, beta=0.1):
        losses = torch.relu(1 - beta * (chosen_logps - rejected_logps))
        return PreferenceOut(losses, beta * chosen_logps.detach(), beta * rejected_logps.detach())

    try:
        assert not preference_needs_reference("test_hinge")
        out = compute_preference_loss("test_hinge", torch.tensor([0.0]), torch.tensor([-20.0]), torch.ones(1),
                                      torch.ones(1), beta=0.1, ref_chosen_logps=torch.zeros(1),
                                      ref_rejected_logps=torch.zeros(1))
        assert out.losses.item() == 0.0  # the reference log-probs a reference-free loss does not take are left out
    finally:
        PREFERENCE_LOSSES.unregister("test_hinge")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown preference loss 'sigmod'.*Did you mean 'sigmoid'"):
        compute_preference_loss("sigmod", torch.zeros(2), torch.zeros(2), torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"1-D \[pairs\] tensors.*rejected_logps': \(3,\)"):
        compute_preference_loss("simpo", torch.zeros(2), torch.zeros(3), torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="unknown preference loss option 'bta'"):
        compute_preference_loss("simpo", torch.zeros(2), torch.zeros(2), torch.ones(2), torch.ones(2), bta=1.0)
