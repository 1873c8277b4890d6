"""The Python executor (the built-in `python` tool): code run in a fresh, sandboxed interpreter
(`sandbox_child.py` says how), with a wall-clock time limit, a memory limit, no network, no new
processes, and a scratch directory it cannot leave; its stdout and stderr captured up to a cap.

    result = await run_python("print(2 ** 10)", scratch_dir, SandboxLimits(timeout_s=5))
    result.output, result.exit_code, result.timed_out, result.truncated, result.scratch_over, result.layers

A run past `timeout_s`, or one that writes more than `max_output_bytes`, is killed; so is one that fills its
scratch directory past `scratch_mb` or `scratch_files` (checked every `SCRATCH_CHECK_S` while it runs, from this
process, out of the code's reach, and once after it ends), whose files are then removed; it cannot have
started another process (a seccomp filter refuses it, root or not), and it dies with the process that
started it. `layers` names the isolation in force: the resource limits, the seccomp filter and the audit
hook always (the code does not run without them), and `netns` and `landlock-vN` where the kernel grants
them. Without Landlock the file-system rules rest on the audit hook alone, which stops ordinary and
naive hostile code but is no security boundary against code that sets out to escape the interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from hybridflow.agents.tools.tool import Tool, ToolContext, ToolResult

CHILD = str(Path(__file__).with_name("sandbox_child.py"))


SCRATCH_CHECK_S = 0.05  # a burst of writes overshoots the scratch limits by at most this long's worth


@dataclass(frozen=True)
class SandboxLimits:
    """timeout_s: wall clock; memory_mb: address space; file_mb: the largest file it may write; scratch_mb and
    scratch_files: the most bytes (of its files together) and entries (files, directories, links) its scratch
    directory may hold; max_output_bytes: stdout + stderr kept (more kills the run)."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    max_output_bytes: int = 16384
    scratch_mb: int = 64
    scratch_files: int = 1000

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "file_mb", "max_output_bytes", "scratch_mb", "scratch_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool {name}={getattr(self, name)!r} is invalid; it must be > 0")


@dataclass
class SandboxResult:
    output: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    scratch_over: str | None = None  # what went over the scratch limits (the run was killed, its files removed)
    layers: list[str] = field(default_factory=list)


def _environment(scratch: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


async def _read_capped(stream: asyncio.StreamReader, limit: int, deadline: float) -> tuple[bytes, bool, bool]:
    """(output, truncated, timed_out): what `stream` yields until EOF, `limit` bytes, or `deadline`."""
    chunks: list[bytes]
    loop, chunks, size = asyncio.get_running_loop(), [], 0
    while True:
        left = deadline - loop.time()
        if left <= 0:
            return b"".join(chunks), False, True
        try:
            chunk = await asyncio.wait_for(stream.read(65536), left)
        except asyncio.TimeoutError:
            return b"".join(chunks), False, True
        if not chunk:
            return b"".join(chunks), False, False
        if size + len(chunk) > limit:
            chunks.append(chunk[:limit - size])
            return b"".join(chunks), True, False
        chunks.append(chunk)
        size += len(chunk)


def scratch_over(scratch: str, limits: SandboxLimits) -> str | None:
    """What of `scratch` is over `limits`' scratch_files / scratch_mb (entries counted without following links,
    the apparent size of its files summed), or None."""
    entries, size, folders = 0, 0, [scratch]
    while folders:
        try:
            listing = list(os.scandir(folders.pop()))
        except OSError:  # removed meanwhile, or no longer readable: nothing of it to count
            continue
        for entry in listing:
            entries += 1
            if entries > limits.scratch_files:
                return f"more than {limits.scratch_files} files (the python tool's scratch_files)"
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    size += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    if size > limits.scratch_mb * 2**20:
        return f"{size / 2**20:.1f} MiB of files, over scratch_mb={limits.scratch_mb}"
    return None


async def _watch_scratch(scratch: str, limits: SandboxLimits, pid: int) -> str:
    """Checks `scratch` every `SCRATCH_CHECK_S` (in a thread: a large folder takes milliseconds); when it is over
    the limits, kills the run's process group and returns what went over."""
    while True:
        await asyncio.sleep(SCRATCH_CHECK_S)
        over = await asyncio.to_thread(scratch_over, scratch, limits)
        if over is not None:
            _kill(pid)
            return over


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _empty(scratch: str) -> None:
    """Removes what `scratch` holds (the directory stays: the episode's next call runs in it)."""
    for entry in os.scandir(scratch):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def run_python(code: str, scratch: str | Path, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a sandboxed interpreter whose working directory is `scratch` (see the module docstring)."""
    scratch = str(Path(scratch).resolve())
    child_limits = {"memory_mb": limits.memory_mb, "cpu_s": math.ceil(limits.timeout_s) + 1,
                    "file_mb": limits.file_mb, "parent": os.getpid()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.timeout_s
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", CHILD, scratch, json.dumps(child_limits), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=scratch, env=_environment(scratch),
        start_new_session=True)
    stdin, stdout = cast(asyncio.StreamWriter, proc.stdin), cast(asyncio.StreamReader, proc.stdout)  # both PIPEs
    watch = asyncio.create_task(_watch_scratch(scratch, limits, proc.pid))
    try:
        try:
            stdin.write(code.encode("utf-8", "replace"))
            await stdin.drain()
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died at start: its output says why
        raw, truncated, timed_out = await _read_capped(stdout, limits.max_output_bytes + 4096, deadline)
        if not (truncated or timed_out):
            try:
                await asyncio.wait_for(proc.wait(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:  # closed its output but kept running
                timed_out = True
    finally:
        watch.cancel()
        if proc.returncode is None:
            _kill(proc.pid)
        # asyncio reports the exit only once the output pipe is closed, and a read stopped at the cap has
        # paused the pipe: read it to its end (bounded: the child was killed and could start nothing).
        try:
            await asyncio.wait_for(_discard(stdout), 5.0)
            await asyncio.wait_for(proc.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
    over = watch.result() if watch.done() and not watch.cancelled() else \
        await asyncio.to_thread(scratch_over, scratch, limits)
    if over is not None:
        await asyncio.to_thread(_empty, scratch)
    header, _, rest = raw.partition(b"\n")
    try:
        layers = list(json.loads(header)["layers"])
    except (ValueError, KeyError, TypeError):
        layers, rest = [], raw
    truncated = truncated or len(rest) > limits.max_output_bytes
    output = rest[:limits.max_output_bytes].decode("utf-8", "replace")
    return SandboxResult(output, None if timed_out or over else proc.returncode, timed_out, truncated, over, layers)


class PythonTool(Tool):
    """The built-in `python` tool; kwargs (the config entry's): timeout_s, memory_mb, file_mb,
    max_output_bytes, scratch_mb, scratch_files (see `SandboxLimits`)."""

    name = "python"
    description = ("Run Python 3 code and return what it prints (stdout and stderr). Every call starts a fresh "
                   "interpreter with no network, limited time and memory, and files only in a scratch "
                   "directory that is kept for the rest of the episode.")
    parameters = {"type": "object", "properties": {"code": {
        "type": "string", "description": "Python source; print the results you need"}}, "required": ["code"]}

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, file_mb: int = 16,
                 max_output_bytes: int = 4096, scratch_mb: int = 64, scratch_files: int = 1000) -> None:
        self.limits = SandboxLimits(timeout_s, memory_mb, file_mb, max_output_bytes, scratch_mb, scratch_files)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        result = await run_python(arguments["code"], context.scratch_dir, self.limits)
        text = result.output
        if result.truncated:
            text += f"\n[output cut at {self.limits.max_output_bytes} bytes]"
        if result.timed_out:
            text += f"\n[stopped: still running after {self.limits.timeout_s:g} s]"
        if result.scratch_over:
            text += f"\n[stopped: the scratch directory held {result.scratch_over}; its files were removed]"
        return ToolResult(text, error=result.timed_out or result.exit_code != 0)
