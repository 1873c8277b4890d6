"""SIGINT / SIGTERM to a run's whole process group (a terminal's Ctrl-C, Slurm's `scancel`, `systemctl stop`)
with two workers: the step finishes, its checkpoint is saved, `hybridflow train` exits 75 (preempted,
resumable), and the same command resumes from that checkpoint. The same under Ray. A Ctrl-C that
`timeout --foreground` forwards (so the run gets it twice) is one signal; a signal while the run starts
stops it at once, with one line, exit 128 + the signal's number and no process left behind."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from rl_helpers import base_overrides, processes_with, read_metrics

from hybridflow import cli
from hybridflow.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager

STARTUP_S = 240


def _signal_the_group_after_a_step(command: list[str], out, sig: signal.Signals) -> tuple[int, str]:
    """Starts `command` in its own session, sends `sig` to its whole process group once a step is logged;
    returns (exit status, output)."""
    run = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or hung before its first step"
            time.sleep(0.1)
        os.killpg(run.pid, sig)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return run.returncode, output


@pytest.mark.parametrize("backend,sig", [
    ("local", signal.SIGINT),
    pytest.param("ray", signal.SIGTERM, marks=[pytest.mark.ray, pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed")]),
])
def test_a_signal_to_the_process_group_saves_exits_75_and_resumes(tiny_qwen2, data_dir, tmp_path, capsys, backend,
                                                                   sig):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_qwen2, data_dir, out, "trainer.val_before_train=false", "trainer.val_every=0",
                               "trainer.n_workers=2", f"trainer.backend={backend}", "trainer.total_steps=200")
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--config", "recipes/grpo.yaml", *overrides]
    status, output = _signal_the_group_after_a_step(command, out, sig)
    checkpoint = CheckpointManager(out).latest()
    assert status == PREEMPTED_EXIT_CODE, output[-3000:]
    assert checkpoint is not None, output[-3000:]
    step = int(checkpoint.name.split("_")[1])
    assert f"hybridflow train: stopped by {sig.name} after step {step}; checkpoint {checkpoint} saved; run the " \
           f"same command again (trainer.resume=auto) to continue from it" in output
    assert "KeyboardInterrupt" not in output and "WorkerDiedError" not in output
    if backend == "ray":
        return
    # Resuming on one (in-process) worker reshards the two workers' checkpoint.
    assert cli.main(["train", *command[4:-1], "trainer.n_workers=1", f"trainer.total_steps={step + 1}"]) == 0
    assert f"resumed from {checkpoint} at step {step}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)][-1] == step + 1


def test_ctrl_c_forwarded_by_timeout_foreground_is_one_signal(tiny_qwen2, data_dir, tmp_path):
    """`timeout --foreground` shares the run's process group and forwards the SIGINT the group already got."""
    out = tmp_path / "run"
    overrides = base_overrides(tiny_qwen2, data_dir, out, "trainer.val_before_train=false", "trainer.val_every=0",
                               "trainer.total_steps=200")
    command = ["timeout", "--foreground", "600", sys.executable, "-m", "hybridflow.cli", "train", "--config",
               "recipes/grpo.yaml", *overrides]
    status, output = _signal_the_group_after_a_step(command, out, signal.SIGINT)
    assert status == PREEMPTED_EXIT_CODE, output[-3000:]
    assert CheckpointManager(out).latest() is not None and "second SIGINT" not in output


def _caught(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("sig,workers", [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_a_signal_while_starting_stops_at_once_leaving_no_process(tiny_qwen2, data_dir, tmp_path, sig, workers):
    out = tmp_path / "run"
    marker = f"HYBRIDFLOW_SIGNAL_TEST={uuid.uuid4().hex}"
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--config", "recipes/grpo.yaml",
               *base_overrides(tiny_qwen2, data_dir, out, f"trainer.n_workers={workers}", "trainer.total_steps=200")]
    run = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **dict([marker.split("=")])})
    try:
        deadline = time.monotonic() + STARTUP_S
        while not (_caught(run.pid, sig) and len(processes_with(marker)) > 1):  # its reward or model workers start
            if run.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run ended or hung before starting: {run.communicate(timeout=60)[1][-3000:]}")
            time.sleep(0.05)
        if sig == signal.SIGINT:  # a Ctrl-C reaches the whole group; a `kill` only the run
            os.killpg(run.pid, sig)
        else:
            run.send_signal(sig)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 128 + sig, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"hybridflow train: stopped at once by {sig.name}; outside a training "
                                            f"step, so nothing in progress was lost; the same command resumes from "
                                            f"the last checkpoint, if there is one")
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == []
