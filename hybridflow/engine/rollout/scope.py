"""The contexts a fast model of a config can serve: the sliding windows its attention implements, and what neither
its attention nor its rotary table implements.

Gemma 3's sliding-window layers (`layer_types`, `sliding_window`) attend over their window at any context length
(`layer_window`, `attention`). The other families' sliding windows are not implemented, so a config whose window is
smaller than `max_model_len` is refused (Mistral's, Phi-3-mini-4k's 2047, a Qwen config with `use_sliding_window`);
below it the window never applies. The rotary table has fixed rows, so Phi-3's longrope past its original context
is refused too (`rope`), and Gemma 3's settings the fast model does not implement are refused by name. With
`engine="auto"` the engine serves such a run through `transformers.generate` instead, saying why.
"""

from __future__ import annotations

from hybridflow.engine.rollout.rope import rotary_problems

GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def default_max_model_len(config, max_model_len: int | None) -> int:
    """`max_model_len`, or min(max_position_embeddings, 4096) when it is None."""
    return max_model_len or min(getattr(config, "max_position_embeddings", None) or 4096, 4096)


def layer_window(config, layer_index: int) -> int | None:
    """The sliding window layer `layer_index` attends within (None: the whole context): Gemma 3's sliding layers'."""
    if config.model_type != "gemma3_text" or config.layer_types[layer_index] != "sliding_attention":
        return None
    return config.sliding_window


def gemma3_problems(config) -> list[str]:
    """What of a Gemma 3 text config the fast model does not implement ([] when it serves it all)."""
    problems = [f"{key}={getattr(config, key)} is set, which the fast path does not implement"
                for key in ("attn_logit_softcapping", "use_bidirectional_attention") if getattr(config, key, None)]
    unknown = sorted(set(config.layer_types) - set(GEMMA3_LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown}: the fast path serves {list(GEMMA3_LAYER_TYPES)}")
    for layer_type, params in (config.rope_parameters or {}).items():
        if (params or {}).get("rope_type") in ("dynamic", "longrope"):
            problems.append(f"rope_parameters[{layer_type!r}] rope_type {params['rope_type']!r} changes with the "
                            f"context in transformers, which a rotary table of fixed rows cannot")
    return problems


def model_problems(config) -> list[str]:
    """What of a config the fast model does not implement at any context length ([] when it serves it all)."""
    return gemma3_problems(config) if config.model_type == "gemma3_text" else []


def context_problems(config, max_model_len: int) -> list[str]:
    """Why the fast path cannot serve sequences of `max_model_len` tokens of this config ([] when it can)."""
    if config.model_type == "gemma3_text":
        return [f"{why}; use engine='hf'" for why in model_problems(config)]
    window = getattr(config, "sliding_window", None)
    uses_window = (config.model_type in ("llama", "mistral", "mixtral", "phi3")
                   or getattr(config, "use_sliding_window", False))
    problems = []
    if window and uses_window and max_model_len > window:
        problems.append(f"max_model_len={max_model_len} exceeds the model's sliding_window={window}, which the fast "
                        f"path does not implement; pass max_model_len <= {window}, or use engine='hf'")
    return problems + [f"max_model_len={max_model_len}: {why}" for why in rotary_problems(config, max_model_len)]
