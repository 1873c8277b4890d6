"""The training engine's forward of a hybrid linear-attention model (Qwen3.5, `qwen3_5_text`; Qwen3-Next, `qwen3_next`,
whose linear layers' projections are grouped by key head): packed rows restart each sequence's recurrent and conv
states (`packed_deltanet`), so the log-probs of a packed row equal each sequence's own forward, and their gradients
those of padded rows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from train_helpers import model_cfg, rl_batch

from hybridflow.engine.linear_attention import packed_mixer
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.packed_deltanet import DELTANET_CLASSES

HYBRID = pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])


def _own_forwards(model, batch, temperature):
    """Per-response-token log-probs from a forward of each row alone, its padding dropped."""
    width = batch["responses"].shape[1]
    out = torch.zeros(batch["responses"].shape)
    for row in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].float() / temperature
        picked = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        real = int(batch["response_mask"][row].sum())
        out[row, :real] = picked[len(ids) - 1 - real:]
    return out * batch["response_mask"]


@HYBRID
def test_packed_rows_equal_each_sequences_own_forward(tiny_model_factory, arch):
    path = tiny_model_factory(arch, layers=4)
    engine = TrainEngine(model_cfg(path), None, head="lm", pack_on_cpu=True)
    batch = rl_batch(rows=5, prompt_width=7, response_width=6, seed=1)
    expected = _own_forwards(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), batch, 0.7)
    packed = engine.infer(batch, micro_batch_size=5, temperature=0.7, pack=True)["log_probs"]
    torch.testing.assert_close(packed * batch["response_mask"], expected, atol=1e-5, rtol=1e-5)
    # the states would otherwise run on across the row: its sequences as one sequence give other outputs
    mixer = next(m for m in engine.model.modules() if type(m).__name__ in DELTANET_CLASSES)
    x = torch.randn(12, engine.model.config.hidden_size)
    with torch.no_grad():
        apart = packed_mixer(mixer, x, torch.tensor([0, 5, 12], dtype=torch.int32))[0]
        joined = packed_mixer(mixer, x, torch.tensor([0, 12], dtype=torch.int32))[0]
    torch.testing.assert_close(apart[:5], joined[:5])
    assert not torch.allclose(apart[5:], joined[5:], atol=1e-3)


@HYBRID
def test_packed_gradients_equal_padded(tiny_model_factory, arch):
    engine = TrainEngine(model_cfg(tiny_model_factory(arch, layers=4)), None, head="lm", pack_on_cpu=True)
    engine.model.requires_grad_(True)
    batch = rl_batch(rows=4, prompt_width=6, response_width=5, seed=2)
    grads = []
    for pack in (True, False):
        out, _ = engine.forward(batch, pack=pack)
        (out["log_probs"] * batch["response_mask"]).sum().backward()
        grads.append({name: p.grad.clone() for name, p in engine.model.named_parameters()})
        engine.model.zero_grad()
    assert any(".linear_attn." in name for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)
