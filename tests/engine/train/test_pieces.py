"""The engine's small parts: lr schedule, micro-batch splitting, FLOPs count, gradient checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import model_cfg, optim_cfg, rl_batch

from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.flops import matmul_params, train_flops
from hybridflow.engine.train.microbatch import (count_micro_batches, group_lengths, group_rows, mini_batch_slices,
                                                split_rows, take_rows)
from hybridflow.engine.train.optim import lr_factor


def test_lr_warmup_then_constant_or_cosine():
    assert [lr_factor(s, 10, "constant", 4, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # warm-up peaks at the 4th step (index 3); cosine runs from there to the floor at the 10th (index 9)
    assert lr_factor(3, 10, "cosine", 4, 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 10, "cosine", 4, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(8, 10, "cosine", 4, 0.1) > 0.1
    assert lr_factor(9, 10, "cosine", 4, 0.1) == lr_factor(12, 10, "cosine", 4, 0.1) == pytest.approx(0.1)
    assert [lr_factor(s, 3, "cosine", 0, 0.0) for s in range(3)] == pytest.approx([1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="cosine"):
        lr_factor(0, 10, "linear", 0, 0.0)


def test_token_budget_groups_stay_under_budget_and_balance():
    lengths = [9, 3, 7, 2, 5, 5, 1, 8]
    k = count_micro_batches(lengths, None, max_tokens=12)
    groups = split_rows(lengths, k, by_tokens=True)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert k == 4 and max(loads) <= 12 and max(loads) - min(loads) <= 3
    assert count_micro_batches(lengths, 3, None) == 3
    assert [len(g) for g in split_rows(lengths, 3, by_tokens=False)] == [3, 3, 2]
    assert split_rows([4], 2, by_tokens=True) == [[0], []]  # more groups than rows: empty ones
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        count_micro_batches(lengths, None, 0)
    parts = mini_batch_slices(7, 3, shuffle=True, seed=1)
    assert sorted(torch.cat(parts).tolist()) == list(range(7)) and [len(p) for p in parts] == [3, 2, 2]


def test_row_groups_stay_together_in_mini_and_micro_batches():
    lengths = [4, 5, 9, 1, 3, 3]  # three groups of two rows (a preference pair's chosen and rejected)
    units = group_lengths(lengths, 2)
    assert units == [9, 10, 6]
    assert group_rows(split_rows(units, 2, by_tokens=True), 2) == [[2, 3], [0, 1, 4, 5]]
    parts = mini_batch_slices(6, 2, shuffle=True, seed=3, row_group=2)
    assert sorted(torch.cat(parts).tolist()) == list(range(6))
    assert all(p[0::2].remainder(2).eq(0).all() and (p[1::2] - p[0::2]).eq(1).all() for p in parts)
    with pytest.raises(ValueError, match="5 rows do not divide into groups of row_group=2"):
        group_lengths(lengths[:5], 2)
    batch = {"input_ids": torch.arange(12).view(4, 3), "response_mask": torch.ones(4, 2)}
    assert take_rows(batch, [], empty_rows=2)["response_mask"].tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_take_rows_picks_rows_or_one_masked_row():
    batch = {"input_ids": torch.arange(12).view(4, 3), "response_mask": torch.ones(4, 2)}
    picked = take_rows(batch, torch.tensor([2, 0]))
    assert picked["input_ids"].tolist() == [[6, 7, 8], [0, 1, 2]] and take_rows(batch, [3])["input_ids"].shape == (1, 3)
    empty = take_rows(batch, [])  # a rank without rows still runs one forward, which adds nothing
    assert empty["input_ids"].tolist() == [[0, 1, 2]] and empty["response_mask"].sum() == 0
    assert batch["response_mask"].sum() == 8  # the caller's rows are untouched


def test_flops_count_matches_the_model_matmuls(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("qwen2", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(model.config) == linear
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    expected = 6 * linear * 30 + 6 * c.num_hidden_layers * c.num_attention_heads * head_dim * (10 ** 2 + 20 ** 2)
    assert train_flops(c, [10, 20]) == expected


def test_gradient_checkpointing_changes_no_gradient(tiny_qwen2):
    batch = rl_batch(rows=3, prompt_width=5, response_width=4, seed=8)

    def loss_fn(out, mb, ctx):
        return -(out["log_probs"] * mb["response_mask"]).sum() / ctx.global_tokens, {}

    moments = []
    for ckpt in (False, True):
        engine = TrainEngine(model_cfg(tiny_qwen2, gradient_checkpointing=ckpt), optim_cfg(), head="lm",
                             pack_on_cpu=True)
        engine.train_step(batch, loss_fn, micro_batch_size=2)
        moments.append([engine.optimizer.state[p]["exp_avg"].clone() for p in engine.model.parameters()])
    for a, b in zip(*moments):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
