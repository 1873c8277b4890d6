"""What exact mode covers: the dense decoder families both engines run with the invariant ops, and the
model shapes their kernels take. `unsupported(config)` names what a Hugging Face config has outside it;
the config check (`hybridflow.config.exact_checks`) and both engines refuse such a model up front."""

from __future__ import annotations

from typing import Any

# the fast rollout engine's dense families; MoE (qwen3_moe, mixtral, ...) and other architectures have no
# invariant path
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
MAX_GROUP = 16  # query heads per KV head the attention kernel's tile holds (`triton_attention.ROWS`)


def unsupported(config: Any) -> list[str]:
    """Why exact mode cannot run the model of `config` ([] when it can)."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return [f"model_type {kind!r} has no exact path (dense {', '.join(ARCHITECTURES)} only: MoE and other "
                f"architectures run kernels of their own in each engine)"]
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r}: the exact MLP is silu-and-mul")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        problems.append(f"attention_dropout={config.attention_dropout}: a training forward with dropout is not "
                        f"the rollout's")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        problems.append(f"head_dim={head_dim}: the exact attention and rotary kernels take a power of two >= 16")
    if heads // kv_heads > MAX_GROUP:
        problems.append(f"{heads // kv_heads} query heads per KV head: the exact attention kernel takes at most "
                        f"{MAX_GROUP}")
    return problems
