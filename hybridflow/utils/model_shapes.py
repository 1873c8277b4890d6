"""The real Qwen2 / Qwen2.5 model shapes (Hugging Face config keywords), in one table: the benchmarks build
random-weight models of them and the memory-budget tests count them on the meta device, so a shape cannot
drift between the two. `SMOLLM2_135M` is the real test model's shape (a Llama), for benchmarks at the
learning race's size without the GGUF. `MOE_SHAPES`: mixtures of experts (`model_type` included) — Qwen3-30B-A3B,
the dense Qwen3 of its active parameters (its attention, and an MLP as wide as its 8 routed experts
together), and a small Qwen3-MoE for quick measurements.

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


# Qwen3-30B-A3B's config.json (rope_theta 1e6, 40,960 positions)
_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6)
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", **_A3B, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    "qwen3-dense-a3b": dict(model_type="qwen3", **_A3B, intermediate_size=8 * 768),
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, vocab_size=151936, tie_word_embeddings=False,
                            intermediate_size=2048, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                            norm_topk_prob=True, max_position_embeddings=4096),
    "qwen3-dense-small": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                              num_key_value_heads=4, head_dim=64, vocab_size=151936, tie_word_embeddings=False,
                              intermediate_size=8 * 256, max_position_embeddings=4096),
}


def moe_shape_config(name: str, **overrides: Any):
    """The `transformers` config of a `MOE_SHAPES` entry (its rope_theta is Qwen3's 1e6)."""
    from transformers import AutoConfig

    shape = {**MOE_SHAPES[name], **overrides}
    return AutoConfig.for_model(shape.pop("model_type"), rope_theta=1e6, **shape)


def tiny_model_kwargs(shape: dict[str, Any]) -> dict[str, Any]:
    """A `QWEN_SHAPES` or `MOE_SHAPES` entry as `build_tiny_model`'s keywords (its vocabulary is the caller's
    `model_vocab_size`, since the tokenizer built beside the model is small)."""
    out = dict(hidden=shape["hidden_size"], intermediate=shape["intermediate_size"],
               layers=shape["num_hidden_layers"], heads=shape["num_attention_heads"],
               kv_heads=shape["num_key_value_heads"], tie_word_embeddings=shape["tie_word_embeddings"])
    if "model_type" in shape:
        out.update(arch=shape["model_type"], head_dim=shape.get("head_dim"))
    if "num_experts" in shape:
        out.update(experts=shape["num_experts"], experts_per_token=shape["num_experts_per_tok"],
                   expert_intermediate=shape["moe_intermediate_size"])
    return out
