"""Fixtures for the data tests: the tiny byte-level tokenizer (with its ChatML template) and file writers."""

from __future__ import annotations

import json

import pytest

from hybridflow.utils.tiny_model import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """`write_jsonl(rows, name="data.jsonl") -> path`: one JSON object per line (raw strings kept as is)."""

    def write(rows, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
        return path

    return write
