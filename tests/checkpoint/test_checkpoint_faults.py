"""GracefulStop on SIGTERM/SIGINT (in-process, and a loop that saves then exits), and
BadStepCounter's skip-then-stop on non-finite steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hybridflow.checkpoint import BadStepCounter, GracefulStop, TrainingDiverged


def test_sigterm_sets_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM" and bool(stop)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_second_signal_interrupts_at_once():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_copy_that_arrives_after_the_graceful_block_is_still_one_signal():
    """`timeout --foreground`'s forwarded copy may land after the step saved and `Preempted` left the block."""
    from hybridflow.checkpoint import Interrupted, StopAtOnce
    from hybridflow.utils.stop_signals import DUPLICATE_WINDOW_S

    with StopAtOnce():
        with GracefulStop() as stop:
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # the copy, now StopAtOnce's: ignored
        time.sleep(DUPLICATE_WINDOW_S)
        with pytest.raises(Interrupted):  # a person's next Ctrl-C stops at once
            os.kill(os.getpid(), signal.SIGINT)


def test_a_library_cleanup_that_fails_as_a_stop_unwinds_it_is_still_that_stop(monkeypatch, capsys):
    """A Ctrl-C inside transformers' loading contexts made their cleanup fail ("trying to pop from empty mode
    stack"), and the worker's start wrapped that error: the run exited 1 with a traceback instead of 130."""
    from hybridflow import cli
    from hybridflow.checkpoint import Interrupted

    def run(args):
        try:
            try:
                raise Interrupted(signal.SIGINT, second=False)
            finally:
                raise RuntimeError("trying to pop from empty mode stack")
        except RuntimeError as cleanup:
            raise ValueError("worker actor rank 0 failed in __init__") from cleanup

    monkeypatch.setattr(cli, "_run", run)
    assert cli.main(["train", "--config", "recipes/grpo.yaml"]) == 128 + signal.SIGINT
    assert "stopped at once by SIGINT; outside a training step" in capsys.readouterr().err

    def fails(args):
        raise ValueError("a plain error")

    monkeypatch.setattr(cli, "_run", fails)
    with pytest.raises(ValueError, match="a plain error"):  # an error no stop caused is not taken for one
        cli.main(["train", "--config", "recipes/grpo.yaml"])


def test_bad_steps_skip_then_stop():
    guard = BadStepCounter(max_in_row=3)
    assert guard.update(1, loss=1.0, grad_norm=torch.tensor(2.0))
    assert not guard.update(2, loss=float("nan"))
    assert not guard.update(3, loss=1.0, grad_norm=torch.tensor(float("inf")))
    assert guard.update(4, loss=torch.tensor([1.0, 2.0]))
    assert (guard.in_row, guard.skipped_total) == (0, 2)
    assert not guard.update(5, loss=float("inf"))
    assert not guard.update(6, loss=float("nan"))
    with pytest.raises(TrainingDiverged, match=r"3 non-finite steps in a row \(the last at step 7: "
                                               r"grad_norm=tensor with 1 non-finite of 2\)"):
        guard.update(7, loss=0.5, grad_norm=torch.tensor([1.0, float("nan")]))
    assert guard.skipped_total == 5


def test_bad_step_counts_survive_resume():
    guard = BadStepCounter(2)
    guard.update(1, loss=float("nan"))
    resumed = BadStepCounter(2)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(TrainingDiverged):
        resumed.update(2, loss=float("nan"))
    with pytest.raises(ValueError, match="max_in_row=0"):
        BadStepCounter(0)


STOPPABLE_LOOP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from hybridflow.checkpoint import CheckpointManager, GracefulStop, save_controller_state
    out, ready = sys.argv[1], Path(sys.argv[2])
    manager = CheckpointManager(out, keep=2)
    with GracefulStop() as stop:
        step = 0
        while True:
            step += 1
            time.sleep(0.02)
            if step == 3:
                ready.write_text("running")
            if stop.requested:
                tmp = manager.begin(step)
                save_controller_state(tmp, step, {"stopped_by": stop.signal_name})
                manager.commit(step, tmp)
                print(f"stopped at step {step} by {stop.signal_name}")
                break
""")


def test_sigterm_stops_a_loop_after_saving(tmp_path):
    from hybridflow.checkpoint import CheckpointManager, read_config

    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", STOPPABLE_LOOP, str(tmp_path / "run"), str(ready)],
                             stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not ready.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and "by SIGTERM" in out
    checkpoint = CheckpointManager(tmp_path / "run").latest()
    assert read_config(checkpoint) == {"stopped_by": "SIGTERM"}
    assert f"stopped at step {int(checkpoint.name.split('_')[1])} " in out


def test_a_signal_arriving_while_a_process_starts_is_answered_when_the_block_ends(monkeypatch):
    """A SIGTERM sent in a `held_signals` block (around a process start, which from the local backend's fork server
    can wait seconds for the server's imports) reaches the handler, which answers it at the block's end. With the
    signals ignored in the block, as until 2026-12-08, it was lost and the run went on."""
    from hybridflow.checkpoint import Interrupted, StopAtOnce
    from hybridflow.utils import stop_signals
    from hybridflow.utils.stop_signals import held_signals

    # the last signal handled, which the copy check reads: put back after this test, so a SIGTERM a test after it
    # delivers within half a second is not taken for a copy of this one
    monkeypatch.setattr(stop_signals, "_last", None)
    with StopAtOnce():
        with pytest.raises(Interrupted, match="SIGTERM outside a training step"):
            with held_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # another thread's handler may run here, between bytecodes: it defers its answer
                reached = True
        assert reached


def mask(pid: int, field: str) -> int:
    """A process's signal set from /proc (`SigBlk`, `SigIgn`)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith(f"{field}:")).split()[1], 16)


def stops_in(bits: int) -> bool:
    return bool(bits >> (signal.SIGINT - 1) & 1 and bits >> (signal.SIGTERM - 1) & 1)


def test_a_process_started_while_signals_are_held_starts_with_them_blocked_and_a_caught_one_waits():
    from hybridflow.checkpoint import Interrupted, StopAtOnce
    from hybridflow.utils.stop_signals import held_signals

    with StopAtOnce():
        pending = signal.getsignal(signal.SIGTERM)  # a signal caught just before the block runs its handler in it
        with pytest.raises(Interrupted, match="SIGTERM outside a training step"):
            with held_signals():
                assert signal.getsignal(signal.SIGTERM) == pending  # the handler stays: nothing is lost
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
                pending(signal.SIGTERM, None)
                reached = True
        assert reached and not stops_in(mask(os.getpid(), "SigBlk"))
    try:
        deadline = time.monotonic() + 10  # the child's /proc entry may still show our image until it execs
        while "time.sleep" not in open(f"/proc/{child.pid}/cmdline").read() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stops_in(mask(child.pid, "SigBlk"))  # a Ctrl-C spares it until it ignores them
        os.kill(child.pid, signal.SIGTERM)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_ignore_stop_signals_ignores_and_unblocks_them_dropping_one_that_waited():
    """What a process started in a `held_signals` block calls first: a SIGTERM that arrived before (blocked,
    waiting) is dropped, and later ones are ignored."""
    code = textwrap.dedent("""
        import os, signal, time
        from hybridflow.utils.stop_signals import ignore_stop_signals
        os.kill(os.getpid(), signal.SIGTERM)  # blocked, as a child of a held block starts: it waits
        ignore_stop_signals()
        os.kill(os.getpid(), signal.SIGINT)
        print(signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), "alive")
    """)
    out = subprocess.run([sys.executable, "-c", "import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
                          "{signal.SIGINT, signal.SIGTERM}); exec(sys.argv[1])", code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "True alive", out.stderr
