"""CheckpointManager: atomic commit, keep-last-k, resolve, stale temp dirs, SIGKILL mid-save, writability."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointError, CheckpointManager, check_writable, is_complete
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
    assert manifest["step"] == 7 and manifest["files"] == {"a.bin": 3}
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


def test_recommit_same_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    _commit(manager, 3, b"a")
    final = _commit(manager, 3, b"b")
    assert (final / "sub" / "weights.bin").read_bytes() == b"b" * 100 and is_complete(final)


def test_damaged_or_unmarked_checkpoints_are_not_resumed(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    good = _commit(manager, 1)
    damaged = _commit(manager, 2)
    (damaged / "sub" / "weights.bin").write_bytes(b"short")
    unmarked = manager.step_dir(3)
    unmarked.mkdir()
    assert manager.latest() == good
    with pytest.raises(CheckpointError, match="damaged"):
        manager.resolve(damaged)
    manager.prune()
    assert not unmarked.exists() and damaged.exists()


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
    with pytest.raises(CheckpointError, match=r"GiB free, but checkpoints need at least"):
        check_writable(tmp_path, min_free_bytes=2**62)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_check_writable_read_only_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            check_writable(locked)
    finally:
        locked.chmod(0o700)


def test_failed_save_is_refused_early_or_aborted(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    done = _commit(manager, 1)
    with pytest.raises(CheckpointError, match="cannot save step 2: .* GiB free.*previous checkpoints are intact"):
        manager.begin(2, min_free_bytes=2**62)
    tmp = manager.begin(2, min_free_bytes=1)
    (tmp / "half.bin").write_bytes(b"x")
    manager.abort(tmp)
    assert not tmp.exists() and manager.latest() == done
    with pytest.raises(CheckpointError, match="refusing to delete"):
        manager.abort(done)
    assert is_complete(done)
