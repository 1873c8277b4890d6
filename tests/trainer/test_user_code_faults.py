"""`hybridflow train` with an environment that exits the process, calls sys.exit, raises KeyboardInterrupt or
hangs in a sync step: the run trains every step, saves, counts the failures in `agent/env_errors`, exits 0
soon after its last step and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

from rl_helpers import processes_with, read_metrics

from hybridflow.checkpoint import CheckpointManager

FAULTS = """
    import os, sys, time
    from hybridflow.agents import EnvStep

    class Faulty:
        def __init__(self, row):
            self.fault = row["extra_info"]["fault"]

        def step(self, text, turn):
            if self.fault == "os_exit":  # after the others failed: it takes their state with it
                time.sleep(1.5)
                os._exit(0)
            if self.fault == "exit":
                sys.exit()
            if self.fault == "interrupt":
                raise KeyboardInterrupt
            if self.fault == "hang":
                time.sleep(600)
            return EnvStep("again")
"""


def test_failing_environments_cost_trajectories_not_the_run(tiny_qwen2, tmp_path):
    env = tmp_path / "faulty.py"
    env.write_text(textwrap.dedent(FAULTS))
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "data_source": "toy",
             "reward_model": {"ground_truth": "1"}, "extra_info": {"fault": fault}}
            for i, fault in enumerate(["os_exit", "exit", "interrupt", "hang"])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    marker = f"HYBRIDFLOW_FAULT_TEST={uuid.uuid4().hex}"
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--config", "recipes/grpo.yaml",
               f"model.path={tiny_qwen2}", f"data.train_files={data}", "data.train_batch_size=4", "rollout.n=1",
               "algorithm.adv_estimator=reinforce_plus_plus", "data.max_prompt_length=64",
               "data.max_response_length=32", "actor.mini_batch_size=null", "trainer.total_steps=2",
               "trainer.val_before_train=false", "reward.num_workers=1", "reward.function=environment",
               f"agent.environment={env}:Faulty", "agent.max_turns=2", "agent.max_tokens_per_turn=4",
               "agent.timeout_s=1", f"trainer.output_dir={out}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, marker.split("=")[0]: marker.split("=")[1]})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["agent/env_errors"] == 4 for m in metrics)  # every row's environment failed, every step
    last = CheckpointManager(out).latest()
    assert last.name == "step_00000002"
    assert time.time() - last.stat().st_mtime < 30  # not held by the sleeping thread (600 s)
    time.sleep(0.5)
    assert processes_with(marker) == []
