"""Helpers shared by the trainer tests: small-run overrides, running `train`, reading metrics.jsonl, reward
functions whose scores differ between the responses to one prompt."""

from __future__ import annotations

import json
import os

from hybridflow.config.loader import load_config
from hybridflow.trainer.rl import train


def base_overrides(model, data_dir, out, *extra):
    return [f"model.path={model}", f"data.train_files={data_dir}/train.parquet",
            f"data.val_files={data_dir}/test.parquet", "data.train_batch_size=2", "data.max_prompt_length=256",
            "data.max_response_length=8", "rollout.n=2", "actor.lr=1e-4", "trainer.total_steps=2",
            "actor.mini_batch_size=null", "critic.mini_batch_size=null",
            "trainer.val_every=2", "reward.num_workers=1", f"trainer.output_dir={out}", *extra]


# The run both Ray tests compare with the local backend (the `local_two_workers` fixture).
TWO_WORKERS = ("trainer.val_before_train=false", "trainer.total_steps=2", "trainer.n_workers=2")


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run(model, data_dir, out, *extra, recipe="recipes/grpo.yaml"):
    train(load_config(base_overrides(model, data_dir, out, *extra), recipe))
    return read_metrics(out)


# A score that differs between almost any two responses (a random tiny model never earns the GSM8K reward).
VARIED = "sum(map(ord, solution_str)) % 997 / 997"


def reward_file(folder, body: str = VARIED) -> str:
    """`reward.function=<this>`: a file defining `reward(data_source, solution_str, ground_truth, extra_info)`
    that returns the Python expression `body` (and takes any `reward.kwargs` a recipe sets)."""
    path = folder / "reward_fn.py"
    path.write_text(f"def reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
                    f"    return {body}\n")
    return f"{path}:reward"


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` ("NAME=value", set for a run under test and
    inherited by everything it starts)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() + b"\0" in f.read():
                    with open(f"/proc/{pid}/stat") as stat:
                        if stat.read().rsplit(") ", 1)[1][0] != "Z":
                            found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found
