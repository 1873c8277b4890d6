"""Fixtures of the agent tests: environment and tool files written for a test; the `openai` clients a test made,
collected when it ends."""

from __future__ import annotations

import gc
import textwrap

import pytest
from endpoint_helpers import CLIENTS_MADE


@pytest.fixture(autouse=True)
def _collect_openai_clients():
    """An `openai` client the test left unclosed sits in a reference cycle; collected later, inside another test's
    event loop, it schedules its close there, on a transport of a loop already closed, and asyncio logs the error
    in that test. Collected here, with no loop running, it closes nothing and logs nothing."""
    yield
    if CLIENTS_MADE[0]:
        CLIENTS_MADE[0] = 0
        gc.collect()


@pytest.fixture
def env_file(tmp_path):
    """`env_file(source) -> 'path.py'`: writes a module (dedented) and returns its path."""
    count = iter(range(1000))

    def write(source: str) -> str:
        path = tmp_path / f"user_module_{next(count)}.py"
        path.write_text(textwrap.dedent(source))
        return str(path)

    return write
