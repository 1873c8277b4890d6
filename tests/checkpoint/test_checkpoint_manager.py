"""CheckpointManager: atomic commit, keep-last-k, resolve, stale temp dirs, SIGKILL mid-save, writability;
a step is never saved twice, damaged checkpoints are named and skipped loudly, the run lock; and the checks
`hybridflow config` makes with nothing written (writability, resolve, the lock)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lock_holder import another_run_holding

from hybridflow.checkpoint import (CheckpointError, CheckpointManager, RunLock, check_unlocked, check_writable,
                                   find_checkpoint, is_complete)
from hybridflow.checkpoint.manager import MANIFEST


def _commit(manager: CheckpointManager, step: int, payload: bytes = b"x") -> Path:
    tmp = manager.begin(step)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "weights.bin").write_bytes(payload * 100)
    return manager.commit(step, tmp)


def test_commit_writes_manifest_and_renames(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    tmp = manager.begin(7)
    assert tmp.parent == tmp_path / "checkpoints" and tmp.name.startswith(".tmp_step_00000007_")
    (tmp / "a.bin").write_bytes(b"abc")
    final = manager.commit(7, tmp)
    assert final == tmp_path / "checkpoints" / "step_00000007" and not tmp.exists()
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["files"] == {"a.bin": {"size": 3, "xxh3": "78af5f94892f3950"}}
    assert manager.latest() == final and manager.step_of(final) == 7


def test_keep_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        _commit(manager, step)
    assert [p.name for p in manager.list()] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_00000003", "step_00000004"]
    keep_all = CheckpointManager(tmp_path, keep=None)
    _commit(keep_all, 5)
    assert len(keep_all.list()) == 3
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointManager(tmp_path, keep=0)


def test_saving_a_step_that_exists_is_refused_before_writing(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    final = _commit(manager, 3, b"a")
    with pytest.raises(CheckpointError, match=r"cannot save step 3: .*step_00000003 already exists, and a "
                                              r"checkpoint is never replaced"):
        manager.begin(3)
    assert (final / "sub" / "weights.bin").read_bytes() == b"a" * 100 and is_complete(final)
    assert [p.name for p in manager.root.iterdir()] == ["step_00000003"]


def test_damaged_or_unmarked_checkpoints_are_not_resumed(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep=3)
    good = _commit(manager, 1)
    damaged = _commit(manager, 2)
    (damaged / "sub" / "weights.bin").write_bytes(b"short")
    unmarked = manager.step_dir(3)
    unmarked.mkdir()
    assert manager.latest() == good
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: sub/weights.bin has 5 bytes, the "
                                              r"manifest says 100"):
        manager.resolve(damaged)
    manager.prune()
    assert not unmarked.exists() and damaged.exists()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep=3)
    good, newest = _commit(manager, 1), _commit(manager, 2, b"y")
    _flip_a_byte(newest / "sub" / "weights.bin")
    assert is_complete(newest)  # the sizes still match: only the checksum tells
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: sub/weights.bin has checksum \w+, "
                                              r"the manifest says \w+ \(its bytes changed\)"):
        manager.resolve(newest)
    assert find_checkpoint(tmp_path) == good  # a run dir: the newest that verifies, with a warning
    err = capsys.readouterr().err
    assert "WARNING: checkpoint" in err and "sub/weights.bin has checksum" in err
    assert f"falling back to the older checkpoint {good}" in err
    assert manager.resolve("auto") == good  # resume=auto also sets the damaged one aside
    err = capsys.readouterr().err
    assert f"resuming from the older checkpoint {good} instead (step_00000002 is kept as " \
           f"damaged_step_00000002 for inspection)" in err
    assert not newest.exists() and (manager.root / "damaged_step_00000002").is_dir()
    assert manager.existing() == [good] and manager.begin(2).exists()


def test_every_checkpoint_damaged_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    only = _commit(manager, 1)
    (only / "sub" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged: .*sub/weights.bin is missing"):
        manager.resolve("auto")
    assert only.exists()


def test_resolve_without_tidying_leaves_a_damaged_checkpoint_in_place(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep=3)
    good, newest = _commit(manager, 1), _commit(manager, 2, b"y")
    _flip_a_byte(newest / "sub" / "weights.bin")
    assert manager.resolve("auto", tidy=False) == good
    assert f"resuming from the older checkpoint {good} instead" in capsys.readouterr().err
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_00000001", "step_00000002"]


def test_check_unlocked_refuses_a_live_runs_directory_and_takes_nothing(tmp_path):
    check_unlocked(tmp_path)  # no lock file: free, and none is made
    check_unlocked(tmp_path / "not_made_yet")
    assert list(tmp_path.iterdir()) == []
    with another_run_holding(tmp_path) as holder:
        record = (tmp_path / ".hybridflow.lock").read_text()
        with pytest.raises(CheckpointError, match=rf"output_dir={tmp_path} is in use by another run: pid "
                                                  rf"{holder.pid} on host {socket.gethostname()} since "):
            check_unlocked(tmp_path)
        assert (tmp_path / ".hybridflow.lock").read_text() == record  # the holder's record is untouched
    check_unlocked(tmp_path)  # the holder is gone: its lock file is stale, and stays as it was
    assert (tmp_path / ".hybridflow.lock").read_text() == record
    RunLock(tmp_path).release()  # the probe let go of the lock


def test_run_lock_refuses_a_second_run_and_takes_over_a_dead_ones(tmp_path):
    with another_run_holding(tmp_path) as holder:
        with pytest.raises(CheckpointError, match=rf"output_dir={tmp_path} is in use by another run: pid "
                                                  rf"{holder.pid} on host {socket.gethostname()} since "):
            RunLock(tmp_path)
    lock = RunLock(tmp_path)  # the holder died without removing its file: the lock is stale
    assert lock.stale_holder.startswith(f"pid {holder.pid} on host ")
    lock.release()
    assert not lock.path.exists()


def test_resolve(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    assert manager.resolve("auto") is None
    first, second = _commit(manager, 1), _commit(manager, 2)
    assert manager.resolve("auto") == second
    assert manager.resolve("never") is None and manager.resolve(None) is None
    assert manager.resolve(str(first)) == first
    assert manager.resolve(tmp_path) == second
    assert manager.resolve(tmp_path / "checkpoints") == second
    with pytest.raises(CheckpointError, match="neither a complete checkpoint"):
        manager.resolve(tmp_path / "nowhere")


def test_stale_temp_dir_of_dead_process_is_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    done = _commit(manager, 1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = manager.root / f".tmp_step_00000002_{socket.gethostname()}_{dead.pid}"
    stale.mkdir()
    alive = manager.begin(3)
    assert manager.latest() == done
    assert not stale.exists() and alive.exists()


SLOW_SAVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from hybridflow.checkpoint import CheckpointManager, save_worker_state
    out, ready = sys.argv[1], Path(sys.argv[2])
    manager = CheckpointManager(out, keep=2)
    tmp = manager.begin(2)
    model = torch.nn.Linear(4, 4)
    save_worker_state(tmp / "actor", model, torch.optim.AdamW(model.parameters()))
    with open(tmp / "actor" / "big.bin", "wb") as fh:
        while True:
            fh.write(b"0" * 4096)
            fh.flush()
            if not ready.exists():
                ready.write_text(str(tmp))
            time.sleep(0.01)
""")


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    import torch

    from hybridflow.checkpoint import load_worker_state, save_worker_state

    manager = CheckpointManager(tmp_path / "run", keep=2)
    model = torch.nn.Linear(4, 4)
    tmp = manager.begin(1)
    save_worker_state(tmp / "actor", model, torch.optim.AdamW(model.parameters()))
    previous = manager.commit(1, tmp)

    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, str(tmp_path / "run"), str(ready)])
    deadline = time.time() + 60
    while not ready.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists(), f"saver did not start (rc={child.poll()})"
    time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    partial = Path(ready.read_text())
    assert partial.exists() and (partial / "actor" / "big.bin").stat().st_size > 0

    assert manager.latest() == previous and is_complete(previous)
    assert not partial.exists(), "the dead saver's temp dir should be cleaned"
    assert manager.resolve("auto") == previous
    restored = torch.nn.Linear(4, 4)
    load_worker_state(previous / "actor", restored)
    assert torch.equal(restored.weight, model.weight)


def test_check_writable(tmp_path):
    assert check_writable(tmp_path / "new" / "out") == (tmp_path / "new" / "out").resolve()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a dir")
    with pytest.raises(CheckpointError, match=r"a_file/out is not writable"):
        check_writable(blocker / "out")
    with pytest.raises(CheckpointError, match=r" free, but a checkpoint needs about 4194304.0 TiB; free space"):
        check_writable(tmp_path, min_free_bytes=2**62)


def test_check_writable_without_creating_says_what_creating_would_and_writes_nothing(tmp_path):
    assert check_writable(tmp_path / "new" / "out", create=False) == (tmp_path / "new" / "out").resolve()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a dir")
    for target, why in ((blocker, "File exists"), (blocker / "out" / "deeper", "Not a directory")):
        for create in (True, False):
            with pytest.raises(CheckpointError) as refused:
                check_writable(target, create=create)
            assert str(refused.value) == (f"output directory {target} is not writable ({why}); choose another "
                                          f"trainer.output_dir or fix its permissions")
    with pytest.raises(CheckpointError, match=r"new/out has .* free, but a checkpoint needs about 4194304.0 TiB"):
        check_writable(tmp_path / "new" / "out", min_free_bytes=2**62, create=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_check_writable_read_only_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        for create in (True, False):
            with pytest.raises(CheckpointError, match=r"locked/out is not writable \(Permission denied\)"):
                check_writable(locked / "out", create=create)
    finally:
        locked.chmod(0o700)


def test_failed_save_is_refused_early_or_aborted(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=2)
    done = _commit(manager, 1)
    with pytest.raises(CheckpointError, match=r"cannot save step 2: .* free, a checkpoint needs about .* \(estimated "
                                              r"from the model sizes\); the previous checkpoints are intact"):
        manager.begin(2, min_free_bytes=2**62)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=50))
    with pytest.raises(CheckpointError, match=rf"cannot save step 2: {manager.root} has 50 B free, a checkpoint "
                                              rf"needs about 1\d\d B \(the size of step_00000001\)"):
        manager.begin(2)
    monkeypatch.undo()
    tmp = manager.begin(2, min_free_bytes=1)
    (tmp / "half.bin").write_bytes(b"x")
    manager.abort(tmp)
    assert not tmp.exists() and manager.latest() == done
    with pytest.raises(CheckpointError, match="refusing to delete"):
        manager.abort(done)
    assert is_complete(done)
