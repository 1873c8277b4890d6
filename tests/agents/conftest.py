"""Fixtures of the agent tests: environment and tool files written for a test."""

from __future__ import annotations

import textwrap

import pytest


@pytest.fixture
def env_file(tmp_path):
    """`env_file(source) -> 'path.py'`: writes a module (dedented) and returns its path."""
    count = iter(range(1000))

    def write(source: str) -> str:
        path = tmp_path / f"user_module_{next(count)}.py"
        path.write_text(textwrap.dedent(source))
        return str(path)

    return write
