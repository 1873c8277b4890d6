"""Where checkpoints live and how one becomes complete: atomic commit, keep-last-k, finding the newest.

Layout under `<output_dir>/checkpoints/`:

    step_00000012/           a complete checkpoint (it has a COMPLETE manifest)
    .tmp_step_00000014_<host>_<pid>/   one being written by process <pid> on <host>
    damaged_step_00000016/   a checkpoint that failed verification, set aside by `resolve("auto")`

A checkpoint is written into a temp dir (`begin`), then `commit` fsyncs every file and directory,
writes the `COMPLETE` manifest (step, every file with its size and checksum: `manifest.py`), renames the
temp dir to `step_<N>` atomically and fsyncs the parent. A process killed at any point leaves either the
previous checkpoints untouched plus a temp dir (cleaned later, once its process is gone) or the new
checkpoint complete. A step that already has a checkpoint is refused by `begin`, before anything is
written: a checkpoint is never replaced, so one run never silently keeps (or overwrites) another's.
Pruning removes the `COMPLETE` marker of an old checkpoint before its files, so a half-deleted
checkpoint never looks complete; the previous checkpoint is pruned only after the new one is committed.

`begin` checks the free space against the size of the newest checkpoint (or a caller's estimate).
`check_writable` finds an unwritable or full output directory before training starts.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from hybridflow.checkpoint.manifest import (MANIFEST, CheckpointError, checkpoint_bytes_on_disk, fsync_path,
                                            is_complete, read_manifest, verify, write_manifest)

__all__ = ["MANIFEST", "CheckpointError", "CheckpointManager", "check_writable", "find_checkpoint",
           "human_bytes", "is_complete", "read_manifest", "verify", "warn"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.tmp_step_(\d+)_(.+)_(\d+)$")
_TRASH_PREFIX = ".trash_"
DAMAGED_PREFIX = "damaged_"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def human_bytes(n: float) -> str:
    """`1536` -> `1.5 KiB`: sizes in messages, readable from bytes to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full(exc: BaseException, free: int) -> bool:
    """Did a save fail because the disk filled? ENOSPC anywhere in the exception chain, its text in a
    worker's traceback, or (torch's zip writer reports "unexpected pos" instead) no space left at all."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free < (1 << 20)


def warn(message: str) -> None:
    """A loud warning on stderr: something was wrong and the run went on another way."""
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _step_dirs(root: Path) -> list[Path]:
    """`step_<N>` dirs directly under `root`, by step."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def _marked_in(root: Path) -> list[Path]:
    """Checkpoints directly under `root` that have a manifest (complete or damaged), oldest first."""
    return [p for p in _step_dirs(root) if (p / MANIFEST).exists()]


def newest_verified(candidates: list[Path], checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest of `candidates` that passes `verify`, or None; [(damaged newer one, what failed)])."""
    damaged: list[tuple[Path, str]] = []
    for path in reversed(candidates):
        try:
            verify(path, checksums)
            return path, damaged
        except CheckpointError as exc:
            damaged.append((path, str(exc)))
    return None, damaged


def _pick(root: Path, checksums: bool) -> Path | None:
    """The newest verified checkpoint under `root`, warning about each damaged newer one; None if there is
    none; `CheckpointError` when there are checkpoints and every one is damaged."""
    candidates = _marked_in(root)
    good, damaged = newest_verified(candidates, checksums)
    if candidates and good is None:
        raise CheckpointError(f"every checkpoint in {root} is damaged: " + "; ".join(r for _, r in damaged))
    for _, reason in damaged:
        warn(f"{reason}; falling back to the older checkpoint {good}")
    return good


def find_checkpoint(path: str | os.PathLike, checksums: bool = True) -> Path:
    """The checkpoint `path` names: itself when it has a manifest (verified, refused naming the damaged
    file), else the newest verified checkpoint in a run's output dir or its `checkpoints/` dir (a damaged
    newer one is skipped with a warning naming the file and the checkpoint used instead). `checksums=False`
    checks file sizes only (to read a checkpoint's config, say)."""
    path = Path(path).expanduser().resolve()
    if (path / MANIFEST).exists():
        verify(path, checksums)
        return path
    for root in (path / "checkpoints", path):
        if (found := _pick(root, checksums)) is not None:
            return found
    raise CheckpointError(f"{path} is neither a complete checkpoint (a dir with a {MANIFEST} manifest) "
                          f"nor a dir holding some")


def check_writable(output_dir: str | Path, min_free_bytes: int = 0, create: bool = True) -> Path:
    """Create `output_dir` if needed, prove a file can be written and fsynced there, and that at least
    `min_free_bytes` are free. Raise `CheckpointError` naming the path and the free space otherwise.
    Call it before any model loads, so a bad output directory costs seconds, not a training run.
    `create=False` checks without writing anything (`hybridflow config`): the directory, or the nearest folder
    above it that exists (where it would be made), must be a directory this process may write into.
    """
    root = Path(output_dir).expanduser().resolve()
    why = _write_probe(root) if create else _cannot_write(root)
    if why is not None:
        raise CheckpointError(f"output directory {root} is not writable ({why}); choose another "
                              f"trainer.output_dir or fix its permissions")
    free = shutil.disk_usage(_nearest_existing(root)).free
    if free < min_free_bytes:
        raise CheckpointError(
            f"output directory {root} has {human_bytes(free)} free, but a checkpoint needs about "
            f"{human_bytes(min_free_bytes)}; free space, lower trainer.keep_checkpoints or choose "
            f"another trainer.output_dir")
    return root


def _write_probe(root: Path) -> str | None:
    """Makes `root` and writes, fsyncs and removes a file in it; None, or why that failed."""
    probe = root / f".write_probe_{socket.gethostname()}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"hybridflow write probe\n")
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _nearest_existing(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists."""
    while not path.exists():
        path = path.parent
    return path


def _cannot_write(root: Path) -> str | None:
    """Why `check_writable` could not make `root` and write into it, in the words its `OSError` would have
    (None: it could), found without writing."""
    found = _nearest_existing(root)
    if not found.is_dir():  # mkdir of the directory itself, or of a folder below a file
        return os.strerror(errno.EEXIST if found == root else errno.ENOTDIR)
    if os.statvfs(found).f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if not os.access(found, os.W_OK | os.X_OK):
        return os.strerror(errno.EACCES)
    return None


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

        Refused with `CheckpointError` before anything is written when `step` already has a checkpoint
        (checkpoints are never replaced), or when the disk has less free space than one checkpoint: the
        newest complete one's size, or `min_free_bytes` (e.g. `estimate_checkpoint_bytes(...)`) when that
        is larger or there is none yet.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be an int >= 0")
        final = self.step_dir(step)
        if final.exists():
            raise CheckpointError(f"cannot save step {step}: {final} "
                                  f"already exists, and a checkpoint is never replaced; move it away, or resume "
                                  f"from it")
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_space(step, min_free_bytes)
        name = [f".tmp_step_{step:08d}_{socket.gethostname()}_{os.getpid()}"]
        if self._distributed():
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.process_group, 0),
                                       group=self.process_group)
        tmp = self.root / name[0]
        if self._is_coordinator():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            fsync_path(self.root)
        self._barrier()
        return tmp

    def _check_space(self, step: int, min_free_bytes: int) -> None:
        need, basis = min_free_bytes, "estimated from the model sizes"
        if (newest := self.latest()) is not None and checkpoint_bytes_on_disk(newest) >= need:
            need, basis = checkpoint_bytes_on_disk(newest), f"the size of {newest.name}"
        free = shutil.disk_usage(self.root).free
        if free < need:
            raise CheckpointError(
                f"cannot save step {step}: {self.root} has {human_bytes(free)} free, a checkpoint needs about "
                f"{human_bytes(need)} ({basis}); the previous checkpoints are intact. Free space, lower "
                f"trainer.keep_checkpoints or choose another trainer.output_dir, then run again to resume")

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
            if final.exists():
                raise CheckpointError(f"cannot commit step {step}: {final} appeared while it was being "
                                      f"written (another run on {self.root.parent}?)")
            write_manifest(tmp, step)
            os.rename(tmp, final)
            fsync_path(self.root)
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

    def remove(self, checkpoint_dir: Path) -> None:
        """Delete a checkpoint so that it is never seen half-deleted as complete."""
        (checkpoint_dir / MANIFEST).unlink(missing_ok=True)
        trash = checkpoint_dir.with_name(f"{_TRASH_PREFIX}{checkpoint_dir.name}_{os.getpid()}")
        os.rename(checkpoint_dir, trash)
        fsync_path(checkpoint_dir.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def set_aside(self, checkpoint_dir: Path) -> Path:
        """Rename a damaged checkpoint to `damaged_step_<N>` (kept for inspection, never resumed or
        written over); return the new path."""
        target = checkpoint_dir.with_name(DAMAGED_PREFIX + checkpoint_dir.name)
        n = 1
        while target.exists():
            target, n = checkpoint_dir.with_name(f"{DAMAGED_PREFIX}{checkpoint_dir.name}.{n}"), n + 1
        os.rename(checkpoint_dir, target)
        fsync_path(self.root)
        return target

    def prune(self) -> list[Path]:
        """Remove complete checkpoints beyond the newest `keep`, and step dirs without a manifest
        (left by a deletion that was cut short); return what was removed. A damaged checkpoint (its
        manifest lists a missing file) is left in place for inspection and is never resumed from."""
        removed = []
        for path in _step_dirs(self.root):
            if not (path / MANIFEST).exists():
                self.remove(path)
                removed.append(path)
        if self.keep is not None:
            for path in self.list()[:-self.keep]:
                self.remove(path)
                removed.append(path)
        return removed

    # ---- reading ------------------------------------------------------------------------------
    def clean_stale(self) -> list[Path]:
        """Delete temp and trash dirs whose writing process (on this host) is gone; return them."""
        removed: list[Path] = []
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
        """Complete checkpoints (every file of the manifest there, with its size), oldest first."""
        return [p for p in _marked_in(self.root) if is_complete(p)]

    def existing(self) -> builtins.list[Path]:
        """Every checkpoint with a manifest, complete or damaged, oldest first."""
        return _marked_in(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; cleans stale temp dirs of dead processes."""
        if self._is_coordinator():
            self.clean_stale()
        complete = self.list()
        return complete[-1] if complete else None

    def resolve(self, resume: str | os.PathLike | None, tidy: bool = True) -> Path | None:
        """What `trainer.resume` means, every checkpoint verified against its manifest's checksums (`tidy=False`:
        the same answer and warnings, but stale temp dirs and damaged checkpoints are left where they are):

        - "auto": the newest checkpoint that verifies, or None (fresh start). A damaged newer one is
          reported on stderr, naming the file that failed and the checkpoint used instead, and set aside
          (`damaged_step_<N>`) so this run never writes over it; when every checkpoint is damaged,
          `CheckpointError` (nothing is set aside).
        - "never" / None / "": None.
        - a path: that checkpoint, refused naming the damaged file; or the newest verified one inside a
          run's output dir or its `checkpoints/` dir.
        """
        if resume is None:
            return None
        word = str(resume).strip().lower()
        if word in ("", "never", "none", "false"):
            return None
        if word == "auto":
            if tidy and self._is_coordinator():
                self.clean_stale()
            good, damaged = newest_verified(self.existing())
            if damaged and good is None:
                raise CheckpointError(f"trainer.resume=auto: every checkpoint in {self.root} is damaged: "
                                      + "; ".join(reason for _, reason in damaged))
            for path, reason in damaged:
                moved = self.set_aside(path) if tidy and self._is_coordinator() else path
                warn(f"{reason}; resuming from the older checkpoint {good} instead ({path.name} is kept as "
                     f"{moved.name} for inspection)")
            return good
        try:
            return find_checkpoint(resume)
        except CheckpointError as exc:
            raise CheckpointError(f"trainer.resume={resume}: {exc}; valid values: auto, never, or a "
                                  f"checkpoint path") from None

    def step_of(self, checkpoint_dir: str | Path) -> int:
        """The step recorded in a complete checkpoint's manifest."""
        return int(read_manifest(checkpoint_dir)["step"])
