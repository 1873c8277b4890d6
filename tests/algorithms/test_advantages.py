"""Advantage estimators against hand-computed numbers and plain-Python loops, plus the registry adapters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    compute_advantages,
    gae,
    get_adv_estimator,
    grpo,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)


def whiten_list(values: list[float]) -> tuple[float, float]:
    """(mean, 1 / sqrt(unbiased var + 1e-8)) of a plain list."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, 1.0 / math.sqrt(var + 1e-8)


def mask_of(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()


def test_gae_hand_computed_single_row():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=1: delta = 1 - 0.2 = 0.8; t=0: delta = 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.72*0.8 = 0.256
    raw = [0.256, 0.8, 0.0]
    assert torch.allclose(ret, torch.tensor([[0.756, 1.0, 9.0]]), atol=1e-6)
    mean, inv_std = whiten_list(raw[:2])
    expected = torch.tensor([[(x - mean) * inv_std for x in raw]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_gae_matches_plain_loop_and_skips_masked_values():
    torch.manual_seed(0)
    lengths = [5, 3, 1, 4]
    mask = mask_of(lengths, 5)
    rewards = torch.randn(4, 5) * mask
    values = torch.randn(4, 5)
    gamma, lam = 0.95, 0.9
    adv, ret = gae(rewards, values, mask, gamma, lam)
    raw = []
    for i, n in enumerate(lengths):
        row, next_v, last = [0.0] * 5, 0.0, 0.0
        for t in reversed(range(n)):
            last = rewards[i, t].item() + gamma * next_v - values[i, t].item() + gamma * lam * last
            next_v = values[i, t].item()
            row[t] = last
        raw.append(row)
    # positions after the end carry nothing back: their raw advantage stays 0
    assert torch.allclose(ret, torch.tensor(raw) + values, atol=1e-5)
    kept = [raw[i][t] for i, n in enumerate(lengths) for t in range(n)]
    mean, inv_std = whiten_list(kept)
    for i, n in enumerate(lengths):
        for t in range(n):
            assert adv[i, t].item() == pytest.approx((raw[i][t] - mean) * inv_std, abs=1e-5)
    # values after the end do not change anything on real tokens
    values2 = values.clone()
    values2[mask == 0] = 123.0
    adv2, _ = gae(rewards, values2, mask, gamma, lam)
    assert torch.allclose(adv2[mask == 1], adv[mask == 1], atol=1e-6)


def test_grpo_hand_computed_with_group_of_one():
    # group "a": scores 1, 0, 1 (the first spread over two tokens); group "b": a single sample with 0.5
    rewards = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.0, 0.0]])
    mask = mask_of([3, 2, 2, 1], 3)
    ids = np.array(["a", "a", "a", "b"], dtype=object)
    adv, ret = grpo(rewards, mask, ids)
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    per_row = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.5 / (1 + 1e-6)]
    assert torch.allclose(adv, torch.tensor(per_row)[:, None] * mask, atol=1e-6)
    assert torch.equal(adv, ret)
    dr_adv, _ = grpo(rewards, mask, ids, scale_by_std=False)
    assert torch.allclose(dr_adv, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5])[:, None] * mask, atol=1e-6)


def test_grpo_equal_scores_give_zero_and_int_ids_work():
    rewards = torch.ones(3, 2)
    adv, _ = grpo(rewards, torch.ones(3, 2), [7, 7, 7])
    assert torch.equal(adv, torch.zeros(3, 2))


def test_rloo_hand_computed():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.5]])
    mask = torch.ones(4, 2)
    adv, ret = rloo(rewards, mask, ["a", "a", "a", "b"])
    # score minus the mean of the other samples of the prompt; the lone sample keeps its score
    assert torch.allclose(adv, torch.tensor([0.5, -1.0, 0.5, 0.5])[:, None].expand(4, 2), atol=1e-6)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[1.0, 2.0, 5.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0 restarts after its end: G = [1 + 0.5*2, 2, 5]; row 1: [0.25, 0.5, 1]
    assert torch.allclose(ret, torch.tensor([[2.0, 2.0, 5.0], [0.25, 0.5, 1.0]]))
    mean, inv_std = whiten_list([2.0, 2.0, 0.25, 0.5, 1.0])
    expected = (ret - mean) * inv_std * mask
    assert torch.allclose(adv, expected, atol=1e-5)
    assert adv[0, 2] == 0


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards = torch.tensor([[0.0, 1.0], [3.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = reinforce_plus_plus_baseline(rewards, mask, ["a", "a", "b"])
    centred = [-1.0, 1.0, 2.0]  # group a mean 2; group b alone, mean 0
    tokens = [-1.0, -1.0, 1.0, 2.0, 2.0]
    mean, inv_std = whiten_list(tokens)
    expected = torch.tensor(centred)[:, None].sub(mean).mul(inv_std) * mask
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.equal(adv, ret)


def test_remax_hand_computed():
    rewards = torch.tensor([[0.0, 0.5, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = remax(rewards, mask, torch.tensor([0.4]))
    assert torch.allclose(ret, torch.tensor([[1.5, 1.5, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[1.1, 1.1, 0.6, 0.0]]))


def test_fully_masked_row_gets_zero_advantage():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    for adv in (grpo(rewards, mask, ["a", "a", "a"])[0], rloo(rewards, mask, ["a", "a", "b"])[0],
                reinforce_plus_plus_baseline(rewards, mask, ["a", "a", "a"])[0],
                reinforce_plus_plus(rewards, mask, 1.0)[0]):
        assert torch.equal(adv[1], torch.zeros(2))


def test_shape_and_group_errors_name_the_input():
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="response_mask"):
        grpo(torch.zeros(2, 3), torch.ones(3, 3), ["a", "b"])
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        grpo(torch.zeros(2, 3), torch.ones(2, 3), ["a", "b", "c"])
    with pytest.raises(ValueError, match="baselines"):
        remax(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="at least 2 masked entries"):
        reinforce_plus_plus(torch.zeros(2, 3), torch.tensor([[1.0, 0, 0], [0, 0, 0]]), 1.0)


def test_compute_advantages_by_name_matches_direct_calls():
    torch.manual_seed(1)
    mask = mask_of([4, 2, 3, 1], 4)
    data = {
        "token_rewards": torch.randn(4, 4) * mask,
        "response_mask": mask,
        "values": torch.randn(4, 4),
        "uid": np.array(["p", "p", "q", "q"], dtype=object),
        "baselines": torch.randn(4),
    }
    cfg = {"gamma": 0.9, "lam": 0.95, "scale_by_std": False, "eps": 1e-6}
    direct = {
        "gae": gae(data["token_rewards"], data["values"], mask, 0.9, 0.95),
        "grpo": grpo(data["token_rewards"], mask, data["uid"], scale_by_std=False),
        "rloo": rloo(data["token_rewards"], mask, data["uid"]),
        "reinforce_plus_plus": reinforce_plus_plus(data["token_rewards"], mask, 0.9),
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline(data["token_rewards"], mask, data["uid"]),
        "remax": remax(data["token_rewards"], mask, data["baselines"]),
    }
    for name, (adv, ret) in direct.items():
        got_adv, got_ret = compute_advantages(name, data, **cfg)
        assert torch.equal(got_adv, adv) and torch.equal(got_ret, ret), name


def test_compute_advantages_errors():
    data = {"token_rewards": torch.zeros(2, 2), "response_mask": torch.ones(2, 2)}
    with pytest.raises(KeyError, match="'values'"):
        compute_advantages("gae", data)
    with pytest.raises(KeyError, match="'baselines'"):
        compute_advantages("remax", data)
    with pytest.raises(KeyError, match="'uid'"):
        compute_advantages("grpo", {**data, "uid": None})
    with pytest.raises(TypeError, match="Did you mean 'gamma'"):
        compute_advantages("reinforce_plus_plus", data, gama=0.9)
    with pytest.raises(ValueError, match="Did you mean 'grpo'"):
        get_adv_estimator("grop")


def test_register_custom_estimator_and_lookup():
    @register_adv_estimator("test_mean_baseline")
    def mean_baseline(data, gamma: float = 1.0):
        score = data["token_rewards"].sum(-1)
        adv = (score - score.mean())[:, None] * data["response_mask"] * gamma
        return adv, adv

    try:
        assert get_adv_estimator("test_mean_baseline") is mean_baseline
        assert "test_mean_baseline" in ADV_ESTIMATORS
        data = {"token_rewards": torch.tensor([[1.0], [3.0]]), "response_mask": torch.ones(2, 1)}
        adv, _ = compute_advantages("test_mean_baseline", data, gamma=2.0, lam=0.5)
        assert torch.equal(adv, torch.tensor([[-2.0], [2.0]]))
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_mean_baseline")(lambda data: None)
    finally:
        ADV_ESTIMATORS.unregister("test_mean_baseline")
    assert "test_mean_baseline" not in ADV_ESTIMATORS


def test_compute_advantages_reads_a_batch():
    from hybridflow.batch import Batch

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.ones(3, 2)
    batch = Batch({"token_rewards": rewards, "response_mask": mask}, {"uid": ["a", "a", "b"]})
    adv, _ = compute_advantages("rloo", batch)
    assert torch.equal(adv, rloo(rewards, mask, ["a", "a", "b"])[0])
    with pytest.raises(KeyError, match="'values'"):
        compute_advantages("gae", batch)


def test_estimator_taking_kwargs_gets_every_option():
    @register_adv_estimator("test_kwargs")
    def takes_all(data, **options):
        return options, None

    try:
        assert compute_advantages("test_kwargs", {}, my_option=3, gamma=0.5) == ({"my_option": 3, "gamma": 0.5}, None)
    finally:
        ADV_ESTIMATORS.unregister("test_kwargs")
