"""The contexts a fast model of a config cannot serve: what neither its attention nor its rotary table implements.

The fast path has no sliding-window attention, so a config whose window is smaller than `max_model_len` is refused
(Mistral's, Phi-3-mini-4k's 2047, a Qwen config with `use_sliding_window`); below it the window never applies.
Its rotary table has fixed rows, so Phi-3's longrope past its original context is refused too (`rope`). With
`engine="auto"` the engine serves such a run through `transformers.generate` instead, saying why.
"""

from __future__ import annotations

from hybridflow.engine.rollout.rope import rotary_problems


def default_max_model_len(config, max_model_len: int | None) -> int:
    """`max_model_len`, or min(max_position_embeddings, 4096) when it is None."""
    return max_model_len or min(getattr(config, "max_position_embeddings", None) or 4096, 4096)


def context_problems(config, max_model_len: int) -> list[str]:
    """Why the fast path cannot serve sequences of `max_model_len` tokens of this config ([] when it can)."""
    window = getattr(config, "sliding_window", None)
    uses_window = (config.model_type in ("llama", "mistral", "mixtral", "phi3")
                   or getattr(config, "use_sliding_window", False))
    problems = []
    if window and uses_window and max_model_len > window:
        problems.append(f"max_model_len={max_model_len} exceeds the model's sliding_window={window}, which the fast "
                        f"path does not implement; pass max_model_len <= {window}, or use engine='hf'")
    return problems + [f"max_model_len={max_model_len}: {why}" for why in rotary_problems(config, max_model_len)]
