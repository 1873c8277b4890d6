"""ModelReward: a tiny random Qwen2ForSequenceClassification scoring texts, batch-invariant."""

from __future__ import annotations

import pytest
import torch

from hybridflow.rewards.model_reward import ModelReward


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hybridflow.utils.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_rm")
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_scores_are_floats_and_independent_of_batching(reward_model_dir):
    rm = ModelReward(str(reward_model_dir), batch_size=4)
    prompts = [[{"role": "user", "content": "What is 2+2?"}], "Say hi: "]
    texts = rm.format_texts(prompts, ["4", "hello there, friend"])
    assert texts[0].startswith("<|im_start|>user\nWhat is 2+2?<|im_end|>") and texts[1] == "Say hi: hello there, friend"
    batched = rm.score(texts)
    single = [rm.score([t])[0] for t in texts]
    assert len(batched) == 2 and all(isinstance(s, float) for s in batched)
    assert batched == pytest.approx(single, abs=1e-5)
    assert batched[0] != pytest.approx(batched[1])


def test_truncation_keeps_the_end(reward_model_dir):
    rm = ModelReward(str(reward_model_dir), max_length=8)
    assert rm.score(["x" * 50 + "tail"]) == pytest.approx(rm.score(["x" * 4 + "tail"]), abs=1e-5)
    with pytest.raises(ValueError, match="label_index 1 is out of range"):
        ModelReward(str(reward_model_dir), label_index=1)
