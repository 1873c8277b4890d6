"""The synthetic GSM8K writer: verl layout, correct answers, deterministic, runnable as a module."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow.parquet as pq

from hybridflow.data.gsm8k_synthetic import DATA_SOURCE, make_rows, write_gsm8k_synthetic


def test_rows_are_verl_gsm8k_shaped_and_correct():
    rows = make_rows(40, "train", seed=0)
    assert make_rows(40, "train", seed=0) == rows and make_rows(40, "train", seed=1) != rows
    for row in rows:
        assert row["data_source"] == DATA_SOURCE and row["ability"] == "math"
        (message,) = row["prompt"]
        assert message["role"] == "user" and '"####"' in message["content"]
        solution = row["extra_info"]["answer"]
        assert solution.endswith(f"#### {row['reward_model']['ground_truth']}")
        # every "a op b = c" step in the worked solution is right
        for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", solution):
            assert eval(f"{a} {op} {b}") == int(c)


def test_writer_files(tmp_path):
    train, val = write_gsm8k_synthetic(tmp_path, n_train=8, n_val=3)
    assert pq.read_table(train).num_rows == 8 and pq.read_table(val).num_rows == 3
    assert set(pq.read_table(train).column_names) == {"data_source", "prompt", "ability", "reward_model",
                                                      "extra_info"}


def test_module_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybridflow.data.gsm8k_synthetic", str(tmp_path / "g"),
                          "--n-train", "4", "--n-val", "2"], capture_output=True, text=True, check=True)
    assert "train.parquet" in out.stdout
    assert pq.read_table(tmp_path / "g" / "test.parquet").num_rows == 2
