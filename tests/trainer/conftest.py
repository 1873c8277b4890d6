"""Fixtures of the trainer tests: a tiny verl-format GSM8K-style dataset, a few SFT conversations, and the
metrics of one local run that the Ray backend's runs must reproduce."""

from __future__ import annotations

import json

import pytest

from hybridflow.data.gsm8k_synthetic import write_gsm8k_synthetic
from rl_helpers import TWO_WORKERS, run


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    write_gsm8k_synthetic(out, n_train=16, n_val=4, seed=0)
    return out


@pytest.fixture(scope="session")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"copy {w}"}, {"role": "assistant", "content": w}]}
            for w in ["abc", "hello", "xyz", "qqq", "test", "foo", "bar", "baz"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def local_two_workers(tiny_qwen2, data_dir, tmp_path_factory):
    """The metrics rows of a 2-step GRPO run with 2 workers on the local backend (`TWO_WORKERS`)."""
    return run(tiny_qwen2, data_dir, tmp_path_factory.mktemp("local_two_workers"), *TWO_WORKERS)
