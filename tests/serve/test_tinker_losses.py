"""The built-in losses `cispo`, `gspo` and `dro` through the real `tinker` SDK, each equal (1e-6) to our own
loss function on the same batch, and `stable_reinforce` refused with the SDK's error."""

from __future__ import annotations

import math

import pytest
import torch

tinker = pytest.importorskip("tinker")

from hybridflow.algorithms.losses import compute_policy_loss, gspo_token_losses  # noqa: E402
from tests.serve.conftest import TOKENS, datum  # noqa: E402

ROWS = [TOKENS[:16], TOKENS[8:24]]


@pytest.fixture(scope="module")
def batch(service_client):
    """A LoRA client, its log-probs of two rows, and "sampler" log-probs and advantages off them."""
    trainer = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    n = len(ROWS[0]) - 1
    out = trainer.forward([datum(r, weights=[1.0] * n) for r in ROWS], "cross_entropy").result()
    logp = torch.stack([o["logprobs"].to_torch() for o in out.loss_fn_outputs])
    gen = torch.Generator().manual_seed(0)
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)  # ratios off 1, some past the clip bounds
    advantages = torch.randn(logp.shape, generator=gen)
    return trainer, logp, old, advantages


def _served_loss(trainer, loss_fn, old, advantages, config, **extra) -> float:
    data = [datum(r, logprobs=old[i].tolist(), advantages=advantages[i].tolist(),
                  **{k: v[i].tolist() for k, v in extra.items()}) for i, r in enumerate(ROWS)]
    return trainer.forward(data, loss_fn, config).result().metrics["loss:sum"]


def test_cispo_equals_our_cispo_loss(batch):
    trainer, logp, old, adv = batch
    got = _served_loss(trainer, "cispo", old, adv, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    ours, _ = compute_policy_loss("cispo", old, logp, adv, torch.ones_like(logp), clip_low=0.1, clip_high=0.1,
                                  agg="token-mean", global_token_count=1)
    assert got == pytest.approx(float(ours), abs=1e-6, rel=1e-6)
    tinker_formula = -(torch.exp(logp - old).clamp(0.9, 1.1) * logp * adv).sum()  # Tinker's documented form
    assert got == pytest.approx(float(tinker_formula), abs=1e-5, rel=1e-5)


def test_gspo_equals_our_gspo_token_losses_over_the_masked_ratio(batch):
    trainer, logp, old, adv = batch
    ratio_mask = torch.zeros_like(logp)
    ratio_mask[:, 6:] = 1.0  # the "sampled" tokens form the sequence ratio; every token still has a loss
    got = _served_loss(trainer, "gspo", old, adv, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
                       sequence_ratio_mask=ratio_mask)
    losses, _, _ = gspo_token_losses(old, logp, adv, ratio_mask, 0.05, 0.05)
    assert got == pytest.approx(float(losses.sum()), abs=1e-6, rel=1e-6)
    seq = torch.exp(((logp - old) * ratio_mask).sum(-1) / ratio_mask.sum(-1)).unsqueeze(-1)  # Tinker's form
    tinker_formula = -torch.minimum(seq * adv, seq.clamp(0.95, 1.05) * adv).sum()
    assert got == pytest.approx(float(tinker_formula), abs=1e-5, rel=1e-5)


def test_dro_equals_the_quadratic_penalty_objective(batch):
    trainer, logp, old, adv = batch
    got = _served_loss(trainer, "dro", old, adv, {"beta": 0.05})
    expected = -(logp * adv - 0.5 * 0.05 * (logp - old) ** 2).sum()
    assert got == pytest.approx(float(expected), abs=1e-6, rel=1e-6)


def test_losses_that_cannot_be_served_are_refused_and_the_server_goes_on(batch):
    trainer, logp, old, adv = batch
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*not served.*ppo, cispo or gspo"):
        _served_loss(trainer, "stable_reinforce", old, adv, {})
    with pytest.raises(tinker.RequestFailedError, match="dro.*needs loss_fn_config \\['beta'\\]"):
        _served_loss(trainer, "dro", old, adv, {})
    with pytest.raises(tinker.RequestFailedError, match="gspo.*missing \\['sequence_ratio_mask'\\]"):
        _served_loss(trainer, "gspo", old, adv, {})
    with pytest.raises(tinker.RequestFailedError, match="cispo.*does not take loss_fn_inputs \\['weights'\\]"):
        _served_loss(trainer, "cispo", old, adv, {}, weights=torch.ones_like(adv))
    assert math.isfinite(_served_loss(trainer, "cispo", old, adv, {}))  # still serving
