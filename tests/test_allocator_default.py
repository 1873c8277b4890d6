"""Importing hybridflow sets PyTorch's CUDA allocator to expandable segments, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import hybridflow, os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"


def _conf_after_import(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if env_value is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = env_value
    return subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_sets_expandable_segments_by_default():
    assert _conf_after_import(None) == "expandable_segments:True"


def test_a_users_allocator_setting_wins():
    assert _conf_after_import("max_split_size_mb:128") == "max_split_size_mb:128"
