"""Fixtures for the rollout engine tests: tiny random models with non-degenerate (spread) weights.

A freshly initialised tiny model (std 0.02, tied embeddings) greedily repeats its last input token,
which would make parity tests pass for the wrong reasons; these fixtures re-draw the weights wider so
that greedy continuations vary and near-ties are rare.
"""

from __future__ import annotations

import pytest
import torch


def spread_weights(src, dst, seed: int = 0, std: float = 0.3):
    """Copy the HF model at `src` to `dst` with weights re-drawn from N(0, std) (norms around 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    GenerationConfig.from_pretrained(src).save_pretrained(dst)
    return dst


def with_config(src, dst, **changes):
    """A copy of the model directory `src` at `dst` with `changes` set on its config."""
    import shutil

    from transformers import AutoConfig

    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = AutoConfig.from_pretrained(src)
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(dst)
    return dst


# Gemma 3's embedding, scaled by sqrt(hidden), dominates a spread model's residual stream: a head tied to it would
# repeat the last token, so its spread models are untied
SPREAD_SIZES = {"gemma3_text": {"tie_word_embeddings": False}}


@pytest.fixture(scope="session")
def spread_model(tiny_model_factory, tmp_path_factory):
    """`spread_model(arch, seed=0, **sizes) -> Path`, each built once per session (`SPREAD_SIZES` by default)."""
    cache = {}

    def factory(arch: str = "qwen2", seed: int = 0, **sizes):
        sizes = {**SPREAD_SIZES.get(arch, {}), **sizes}
        key = (arch, seed, tuple(sorted(sizes.items())))
        if key not in cache:
            cache[key] = spread_weights(tiny_model_factory(arch, **sizes),
                                        tmp_path_factory.mktemp(f"spread_{arch}"), seed)
        return cache[key]

    return factory
