"""Where checkpoints live and how one becomes complete: atomic commit, keep-last-k, finding the newest.

Layout under `<output_dir>/checkpoints/`:

    step_00000012/           a complete checkpoint (it has a COMPLETE manifest)
    .tmp_step_00000014_<host>_<pid>/   one being written by process <pid> on <host>

A checkpoint is written into a temp dir (`begin`), then `commit` fsyncs every file and directory,
writes the `COMPLETE` manifest (step, every file with its size), renames the temp dir to `step_<N>`
atomically and fsyncs the parent. A process killed at any point leaves either the previous checkpoints
untouched plus a temp dir (cleaned later, once its process is gone) or the new checkpoint complete.
Pruning removes the `COMPLETE` marker of an old checkpoint before its files, so a half-deleted
checkpoint never looks complete; the previous checkpoint is pruned only after the new one is committed.

`check_writable` finds an unwritable or full output directory before training starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch.distributed as dist

MANIFEST = "COMPLETE"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.tmp_step_(\d+)_(.+)_(\d+)$")
_TRASH_PREFIX = ".trash_"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read; the message names the path and the fix."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file and directory under `root` (deepest first); return {relative path: size}."""
    files: dict[str, int] = {}
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = Path(dirpath) / name
            _fsync_path(path)
            files[path.relative_to(root).as_posix()] = path.stat().st_size
        _fsync_path(Path(dirpath))
    return dict(sorted(files.items()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_manifest(checkpoint_dir: str | Path) -> dict:
    """The `COMPLETE` manifest of a checkpoint: {"step", "files": {path: size}, "format", "time"}."""
    path = Path(checkpoint_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint: no {MANIFEST} file") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is corrupt ({exc}); this checkpoint cannot be trusted") from None


def is_complete(checkpoint_dir: str | Path) -> bool:
    """True when the manifest exists and every file it lists is present with its recorded size."""
    root = Path(checkpoint_dir)
    try:
        manifest = read_manifest(root)
        return all((root / rel).stat().st_size == size for rel, size in manifest["files"].items())
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return False


def _step_dirs(root: Path) -> list[Path]:
    """`step_<N>` dirs directly under `root`, by step."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def _complete_in(root: Path) -> list[Path]:
    """Complete checkpoints directly under `root`, oldest first."""
    return [p for p in _step_dirs(root) if is_complete(p)]


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names: itself when it has a manifest (refused if damaged), else the newest
    complete checkpoint in a run's output dir or its `checkpoints/` dir; `CheckpointError` otherwise."""
    path = Path(path).expanduser().resolve()
    if (path / MANIFEST).exists():
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is damaged (a file listed in its {MANIFEST} "
                                  f"manifest is missing or has another size)")
        return path
    for root in (path / "checkpoints", path):
        if (found := _complete_in(root)):
            return found[-1]
    raise CheckpointError(f"{path} is neither a complete checkpoint (a dir with a {MANIFEST} manifest) "
                          f"nor a dir holding some")


def check_writable(output_dir: str | Path, min_free_bytes: int = 0) -> Path:
    """Create `output_dir` if needed, prove a file can be written and fsynced there, and that at least
    `min_free_bytes` are free. Raise `CheckpointError` naming the path and the free space otherwise.
    Call it before any model loads, so a bad output directory costs seconds, not a training run.
    """
    root = Path(output_dir).expanduser().resolve()
    probe = root / f".write_probe_{socket.gethostname()}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"hybridflow write probe\n")
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"output directory {root} is not writable ({exc.strerror or exc}); choose another "
            f"trainer.output_dir or fix its permissions") from None
    free = shutil.disk_usage(root).free
    if free < min_free_bytes:
        raise CheckpointError(
            f"output directory {root} has {free / 2**30:.2f} GiB free, but checkpoints need at least "
            f"{min_free_bytes / 2**30:.2f} GiB; free space, lower trainer.keep_checkpoints or choose "
            f"another trainer.output_dir")
    return root


class CheckpointManager:
    """Atomic, keep-last-k checkpoint directories under `<output_dir>/checkpoints/`.

    `keep`: how many complete checkpoints to keep (None keeps all). `process_group`: when given (and
    torch.distributed is initialised), `begin` and `commit` are collective: every rank calls them,
    rank 0 picks the temp dir name, renames and prunes, and barriers keep the ranks in step.
    """

    def __init__(self, output_dir: str | Path, keep: int | None = 2, process_group=None):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r}: must be an int >= 1 (or None to keep every checkpoint)")
        self.root = Path(output_dir).expanduser().resolve() / "checkpoints"
        self.keep = keep
        self.process_group = process_group

    # ---- distributed helpers ----------------------------------------------------------------
    def _distributed(self) -> bool:
        return self.process_group is not None and dist.is_available() and dist.is_initialized()

    def _is_coordinator(self) -> bool:
        return not self._distributed() or dist.get_rank(self.process_group) == 0

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self.process_group)

    # ---- writing ------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        """Where the complete checkpoint of `step` lives (whether or not it exists)."""
        return self.root / f"step_{step:08d}"

    def begin(self, step: int, min_free_bytes: int = 0) -> Path:
        """Make and return a fresh temp dir for the checkpoint of `step` (same path on every rank).

        `min_free_bytes` (e.g. `estimate_checkpoint_bytes(...)`): refuse, before anything is written,
        when the disk has less free space, instead of failing half-way through the save.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be an int >= 0")
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < min_free_bytes:
            raise CheckpointError(
                f"cannot save step {step}: {self.root} has {free / 2**30:.2f} GiB free, the checkpoint "
                f"needs about {min_free_bytes / 2**30:.2f} GiB; the previous checkpoints are intact")
        name = [f".tmp_step_{step:08d}_{socket.gethostname()}_{os.getpid()}"]
        if self._distributed():
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.process_group, 0),
                                       group=self.process_group)
        tmp = self.root / name[0]
        if self._is_coordinator():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            _fsync_path(self.root)
        self._barrier()
        return tmp

    def commit(self, step: int, tmp_dir: str | Path) -> Path:
        """Make `tmp_dir` the complete checkpoint `step_<N>` and prune to the last `keep`; return it.

        Collective when a process group was given: call it on every rank after all ranks wrote.
        """
        tmp = Path(tmp_dir)
        final = self.step_dir(step)
        self._barrier()
        if self._is_coordinator():
            if not tmp.is_dir() or tmp.resolve().parent != self.root:
                raise CheckpointError(f"cannot commit step {step}: {tmp} is not a temp dir made by "
                                      f"begin() under {self.root}")
            files = _fsync_tree(tmp)
            manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "files": files}
            with open(tmp / MANIFEST, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_path(tmp)
            if final.exists():
                self._remove(final)
            os.rename(tmp, final)
            _fsync_path(self.root)
            self.prune()
        self._barrier()
        return final

    def abort(self, tmp_dir: str | Path) -> None:
        """Delete the temp dir of a save that failed (a worker died, the disk filled); the complete
        checkpoints are untouched. Safe to call from several ranks at once."""
        tmp = Path(tmp_dir)
        if not _TMP_RE.match(tmp.name) or tmp.resolve().parent != self.root:
            raise CheckpointError(f"refusing to delete {tmp}: not a temp dir made by begin() under {self.root}")
        shutil.rmtree(tmp, ignore_errors=True)

    def _remove(self, checkpoint_dir: Path) -> None:
        """Delete a checkpoint so that it is never seen half-deleted as complete."""
        (checkpoint_dir / MANIFEST).unlink(missing_ok=True)
        trash = checkpoint_dir.with_name(f"{_TRASH_PREFIX}{checkpoint_dir.name}_{os.getpid()}")
        os.rename(checkpoint_dir, trash)
        _fsync_path(checkpoint_dir.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self) -> list[Path]:
        """Remove complete checkpoints beyond the newest `keep`, and step dirs without a manifest
        (left by a deletion that was cut short); return what was removed. A damaged checkpoint (its
        manifest lists a missing file) is left in place for inspection and is never resumed from."""
        removed = []
        for path in _step_dirs(self.root):
            if not (path / MANIFEST).exists():
                self._remove(path)
                removed.append(path)
        if self.keep is not None:
            for path in self.list()[:-self.keep]:
                self._remove(path)
                removed.append(path)
        return removed

    # ---- reading ------------------------------------------------------------------------------
    def clean_stale(self) -> list[Path]:
        """Delete temp and trash dirs whose writing process (on this host) is gone; return them."""
        removed = []
        if not self.root.is_dir():
            return removed
        host = socket.gethostname()
        for path in self.root.iterdir():
            m = _TMP_RE.match(path.name)
            stale_tmp = m is not None and m.group(2) == host and not _pid_alive(int(m.group(3)))
            if stale_tmp or path.name.startswith(_TRASH_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return _complete_in(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; cleans stale temp dirs of dead processes."""
        if self._is_coordinator():
            self.clean_stale()
        complete = self.list()
        return complete[-1] if complete else None

    def resolve(self, resume: str | os.PathLike | None) -> Path | None:
        """What `trainer.resume` means: "auto" → the newest complete checkpoint or None (fresh start);
        "never" / None / "" → None; a path → that checkpoint (or the newest complete one inside a run's
        output dir or its `checkpoints/` dir), refused with a clear error if it is not complete."""
        word = str(resume).strip().lower() if resume is not None else "never"
        if word in ("", "never", "none", "false"):
            return None
        if word == "auto":
            return self.latest()
        try:
            return find_checkpoint(resume)
        except CheckpointError as exc:
            raise CheckpointError(f"trainer.resume={resume}: {exc}; valid values: auto, never, or a "
                                  f"checkpoint path") from None

    def step_of(self, checkpoint_dir: str | Path) -> int:
        """The step recorded in a complete checkpoint's manifest."""
        return int(read_manifest(checkpoint_dir)["step"])
