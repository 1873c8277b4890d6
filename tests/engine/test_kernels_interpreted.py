"""The Triton kernels on the CPU, under Triton's interpreter, in a process of its own with TRITON_INTERPRET=1: the
invariant ops' (`interpreted_kernels.py`) and the rollout engine's own (`interpreted_rollout_kernels.py`). Their
indexing, masks and launch arguments are checked in every `make test`, not only in a GPU session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_the_triton_kernels_compute_their_pytorch_twins_maths_under_the_interpreter():
    here = Path(__file__).parent
    files = [str(here / "interpreted_kernels.py"), str(here / "interpreted_rollout_kernels.py")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                            env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "13 passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
