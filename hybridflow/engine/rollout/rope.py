"""The fast path's rotary tables: `transformers`' own rotary embedding for the config, evaluated once for every
position, and the rotary configurations a table of fixed rows cannot serve.

HF's rotary embeddings take rope_theta and the `rope_parameters` scaling types (llama3, linear, yarn, ...) from the
config. Phi-3's (`Phi3RotaryEmbedding`) also rotates only the first `partial_rotary_factor` of each head (Phi-4-mini:
0.75), which Llama's ignores, so a Phi-3 config takes its own class. Phi-3's `longrope` (`su` in older configs: the
128k variants) is dynamic in transformers: a forward whose positions reach past `original_max_position_embeddings`
uses the long factors for every position, a shorter one the short factors. One table for every position matches that
only while the context stays within the original length, where the short factors hold; a longer context is refused.
Qwen3.5's (`Qwen3_5TextRotaryEmbedding`) rotates a quarter of each head, its multimodal sections all at the text
position.
"""

from __future__ import annotations

import torch


def rotary_dim(config) -> int:
    """How many leading dimensions of each head are rotated (the head, unless `partial_rotary_factor` < 1)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim * factor)


def rotary_problems(config, max_len: int) -> list[str]:
    """Why a table of `max_len` fixed rows cannot give the rotation transformers gives ([] when it can)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return []
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings")
    if max_len <= original:
        return []
    return [f"rope_parameters rope_type 'longrope' switches from its short to its long factors past "
            f"original_max_position_embeddings={original} (transformers picks them per forward, which a rotary "
            f"table of fixed rows cannot); pass max_model_len <= {original}, or use engine='hf'"]


def rotary_table(config, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary_dim(config)] fp32 from the family's HF rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    classes = {"phi3": Phi3RotaryEmbedding, "qwen3_5_text": Qwen3_5TextRotaryEmbedding}
    rope = classes.get(config.model_type, LlamaRotaryEmbedding)(config).to(device)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = (t[0] for t in rope(dummy, torch.arange(max_len, device=device)[None]))
    return cos, sin
