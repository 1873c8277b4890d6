"""Fixtures of the trainer tests: a tiny verl-format GSM8K-style dataset."""

from __future__ import annotations

import pytest

from hybridflow.data.gsm8k_synthetic import write_gsm8k_synthetic


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    write_gsm8k_synthetic(out, n_train=16, n_val=4, seed=0)
    return out
