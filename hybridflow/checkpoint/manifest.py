"""The `COMPLETE` manifest that makes a checkpoint directory complete, and checking a checkpoint against it.

`write_manifest` fsyncs every file and directory of a finished checkpoint and records each file's size
and xxh3-64 checksum: ``{"format": 2, "step", "time", "files": {relative path: {"size", "xxh3"}}}``
(format 1, written before checksums existed, maps each path to its size alone and is still read).

Two checks: `is_complete` compares sizes only (cheap: listing and pruning use it), `verify` also reads
every file and compares checksums (resume and export use it before any weights load), and names the
first file that fails. xxh3 reads at several GiB/s, so verifying costs about as much as reading the
checkpoint once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import xxhash

MANIFEST = "COMPLETE"
FORMAT_VERSION = 2
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read; the message names the path and the fix."""


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_checksum(path: Path) -> str:
    """The xxh3-64 checksum of a file, as 16 hex digits."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(checkpoint_dir: Path, step: int) -> None:
    """fsync every file and directory under `checkpoint_dir` (deepest first), then write and fsync the
    manifest listing each file's size and checksum."""
    files: dict[str, dict] = {}
    for dirpath, _dirnames, filenames in os.walk(checkpoint_dir, topdown=False):
        for name in filenames:
            path = Path(dirpath) / name
            fsync_path(path)
            files[path.relative_to(checkpoint_dir).as_posix()] = {"size": path.stat().st_size,
                                                                  "xxh3": file_checksum(path)}
        fsync_path(Path(dirpath))
    manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "files": dict(sorted(files.items()))}
    with open(checkpoint_dir / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_path(checkpoint_dir)


def read_manifest(checkpoint_dir: str | Path) -> dict:
    """The `COMPLETE` manifest of a checkpoint (see the module docstring)."""
    path = Path(checkpoint_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint: no {MANIFEST} file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint_dir} is damaged: its {MANIFEST} manifest does not "
                              f"parse ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint {checkpoint_dir} is damaged: its {MANIFEST} manifest lists no files")
    return manifest


def _entry(value: int | dict) -> tuple[int, str | None]:
    """(size, checksum or None) of a manifest entry of either format."""
    return (value, None) if isinstance(value, int) else (int(value["size"]), value.get("xxh3"))


def file_problem(root: Path, rel: str, value: int | dict, checksums: bool) -> str | None:
    """What is wrong with file `rel` of a checkpoint against its manifest entry, or None."""
    size, checksum = _entry(value)
    path = root / rel
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{rel} is missing"
    if actual != size:
        return f"{rel} has {actual} bytes, the manifest says {size}"
    if checksums and checksum is not None and (found := file_checksum(path)) != checksum:
        return f"{rel} has checksum {found}, the manifest says {checksum} (its bytes changed)"
    return None


def verify(checkpoint_dir: str | Path, checksums: bool = True) -> dict:
    """Raise `CheckpointError` naming the first file of the checkpoint that is missing, has another size
    or (with `checksums`) another checksum than its manifest says; return the manifest."""
    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    for rel, value in manifest["files"].items():
        try:
            problem = file_problem(root, rel, value, checksums)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            problem = f"{rel} cannot be checked ({exc})"
        if problem:
            raise CheckpointError(f"checkpoint {root} is damaged: {problem}")
    return manifest


def is_complete(checkpoint_dir: str | Path) -> bool:
    """True when the manifest exists and every file it lists is present with its recorded size."""
    try:
        verify(checkpoint_dir, checksums=False)
    except CheckpointError:
        return False
    return True


def checkpoint_bytes_on_disk(checkpoint_dir: str | Path) -> int:
    """The bytes a complete checkpoint takes, from its manifest."""
    return sum(_entry(value)[0] for value in read_manifest(checkpoint_dir)["files"].values())
