"""The real Qwen2 / Qwen2.5 model shapes (Hugging Face config keywords), in one table: the benchmarks build
random-weight models of them and the memory-budget tests count them on the meta device, so a shape cannot
drift between the two. `SMOLLM2_135M` is the real test model's shape (a Llama), for benchmarks at the
learning race's size without the GGUF.

    AutoConfig.for_model("qwen2", **QWEN_SHAPES["7b"])
    build_tiny_model(path, **tiny_model_kwargs(QWEN_SHAPES["7b"]), model_vocab_size=...)
"""

from __future__ import annotations

from typing import Any

QWEN_SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}

SMOLLM2_135M: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                    tie_word_embeddings=True, rope_theta=100000.0)


def tiny_model_kwargs(shape: dict[str, Any]) -> dict[str, Any]:
    """A `QWEN_SHAPES` entry as `build_tiny_model`'s keywords (its vocabulary is the caller's
    `model_vocab_size`, since the tokenizer built beside the model is small)."""
    return dict(hidden=shape["hidden_size"], intermediate=shape["intermediate_size"],
                layers=shape["num_hidden_layers"], heads=shape["num_attention_heads"],
                kv_heads=shape["num_key_value_heads"], tie_word_embeddings=shape["tie_word_embeddings"])
