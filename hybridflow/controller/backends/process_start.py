"""How the local backend starts a rank's process: forked from a fork server for CPU groups, spawned for GPU groups.

A spawned interpreter imports torch, transformers and hybridflow again (~2.5 s of CPU a process). The fork
server is a clean interpreter (exec'd, not forked from the controller, so it holds no process group, no CUDA
context and none of the controller's threads) that has imported `PRELOAD` once; each process is forked from it
and starts in a fraction of a second. multiprocessing keeps one server per controller, started by the first
group that needs it; it exits when the controller does (its "alive" pipe closes), however the controller ends.

What a forked process does not get from its `Process.start()`, and how it gets it instead:
- the environment: it has the server's (the controller's when the server started), so the local backend hands
  each process the whole environment it should have and the process puts it in place first thing. What the
  preloaded modules read at import (huggingface_hub's HF_HOME and HF_HUB_OFFLINE, OpenMP's thread count, which a
  CPU group's ranks set anyway) comes from the controller's environment when the first CPU group started;
- SIGINT and SIGTERM: the server is started with both blocked (`held_signals`), so a Ctrl-C to the process group
  reaches neither it, half-way through its imports, nor a child before it calls `ignore_stop_signals` (the server
  ignores SIGINT once its imports are done and keeps SIGTERM blocked: it ends with the controller; its children
  start with both blocked, as the server has them);
- its parent is the server, not the controller: the parent watch of `local.py` looks at both.
The first start from a new server waits for its imports (seconds): a signal then is answered when the start returns
(`held_signals`), not lost; and a run stopped by a signal ends the server before its last line (`stop_fork_server`),
which a server still importing would otherwise print after.
sys.path and the working directory are the controller's at `Process.start()` (multiprocessing sends them).

GPU groups are spawned as before: `transformers.modeling_utils` imports torchao where it is installed, which asks
CUDA about the devices at import (`torch.utils._triton.has_triton`); in the server that would initialize CUDA,
which a forked child can no longer use, and hiding the GPUs from the server would leave every child with a cached
"no GPU, no Triton". The server therefore starts with no GPU visible and serves CPU groups only; a GPU worker's
start is dominated by loading its model anyway. Where there is no fork server (Windows) every group is spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

from hybridflow.utils.stop_signals import held_signals

# what every rank imports anyway (the worker classes and both engines); multiprocessing skips one that raises
# ImportError, so a package missing here costs only the time saved
PRELOAD = ["torch", "transformers.modeling_utils", "hybridflow.engine.train", "hybridflow.workers"]

_env_lock = threading.Lock()


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
    """Sets `updates` in os.environ while a process is started (it copies it at exec), then restores it."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def fork_server_context() -> Any:
    """multiprocessing's forkserver context with its server running (started here, with `PRELOAD`, no GPU
    visible and the stop signals ignored, if it is not yet); the spawn context where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read only when the server starts
    with held_signals(), environ({"CUDA_VISIBLE_DEVICES": ""}):
        forkserver.ensure_running()
    return ctx


def stop_fork_server() -> None:
    """Ends this process's fork server now, if one runs (killed: it may be half-way through `PRELOAD`, which it
    would finish first, printing what the imports print). A run stopped by a signal calls it before its last line,
    so nothing of the run's prints after that line nor outlives it; its ranks are shut down by then. A later CPU
    group starts a new server. multiprocessing keeps the server in its module (`_forkserver`, whose `_stop` closes
    the alive pipe, reaps the process and removes its socket): the only handle there is to it."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()


def start_context(device_type: str) -> Any:
    """The multiprocessing context a group on `device_type` starts its ranks with (module docstring)."""
    return fork_server_context() if device_type == "cpu" else mp.get_context("spawn")
