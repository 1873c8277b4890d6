"""The fast path's rotary tables: `transformers`' own rotary embedding for the config, evaluated once for every
position, and the rotary configurations a table of fixed rows cannot serve.

HF's rotary embeddings take rope_theta and the `rope_parameters` scaling types (llama3, linear, yarn, ...) from the
config. Phi-3's (`Phi3RotaryEmbedding`) also rotates only the first `partial_rotary_factor` of each head (Phi-4-mini:
0.75), which Llama's ignores, so a Phi-3 config takes its own class. Phi-3's `longrope` (`su` in older configs: the
128k variants) is dynamic in transformers: a forward whose positions reach past `original_max_position_embeddings`
uses the long factors for every position, a shorter one the short factors. One table for every position matches that
only while the context stays within the original length, where the short factors hold; a longer context is refused.

Gemma 3 rotates its sliding-window layers and its global layers by different tables (`rope_parameters` per layer
type: the local base, 10,000, and the global one, 1,000,000 with linear scaling in the 4B and larger models).
Its table holds them side by side, [max_len, types x head_dim] in `Gemma3RotaryEmbedding`'s order of the layer
types; each layer reads its own columns (`rope_columns`), a strided view the kernels take by its row stride.

Qwen3.5's (`Qwen3_5TextRotaryEmbedding`) rotates a quarter of each head, its multimodal sections all at the text
position; Qwen3-Next's (`Qwen3NextRotaryEmbedding`) a quarter too, with plain positions.
"""

from __future__ import annotations

import torch


def layer_rope_types(config) -> list[str]:
    """The layer types with a table of their own, in the order their tables sit side by side ([] for one table)."""
    return sorted(set(config.layer_types)) if config.model_type == "gemma3_text" else []


def rope_columns(config, layer_index: int) -> slice | None:
    """The columns of the rotary table that layer `layer_index` reads (None: all of them)."""
    types = layer_rope_types(config)
    if not types:
        return None
    width = rotary_dim(config)
    start = types.index(config.layer_types[layer_index]) * width
    return slice(start, start + width)


def rotary_dim(config) -> int:
    """How many leading dimensions of each head are rotated (the head, unless `partial_rotary_factor` < 1)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = getattr(config, "rope_parameters", None) or {}
    factor = 1.0 if layer_rope_types(config) else params.get("partial_rotary_factor", 1.0)
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
    """cos, sin [max_len, rotary_dim(config)] fp32 from the family's HF rotary embedding (Gemma 3: its layer
    types' tables side by side, [max_len, types x rotary_dim(config)])."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    dummy, positions = torch.zeros(1, dtype=torch.float32, device=device), torch.arange(max_len, device=device)[None]
    types = layer_rope_types(config)
    if types:
        gemma = Gemma3RotaryEmbedding(config).to(device)
        tables = [gemma(dummy, positions, layer_type) for layer_type in types]
        return torch.cat([cos[0] for cos, _ in tables], -1), torch.cat([sin[0] for _, sin in tables], -1)
    classes = {"phi3": Phi3RotaryEmbedding, "qwen3_5_text": Qwen3_5TextRotaryEmbedding,
               "qwen3_next": Qwen3NextRotaryEmbedding}  # Llama's would rotate whole heads
    rope = classes.get(config.model_type, LlamaRotaryEmbedding)(config).to(device)
    if config.model_type == "qwen3_5_text":  # multimodal sections: positions [3, 1, L], a text token's t = h = w
        positions = positions.expand(3, -1, -1)  # (some transformers 5.x versions index them as 3-D, others expand)
    cos, sin = (t[0] for t in rope(dummy, positions))
    return cos, sin
