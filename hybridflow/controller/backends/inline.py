"""The in-process backend: a one-worker group that runs inside the controller (so `breakpoint()`
works). All inline groups share the controller's world-size-1 default process group. What the worker
prints while it builds and while it runs a call starts with ``(role rank 0) ``, as a process worker's does."""

from __future__ import annotations

import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hybridflow.batch import Batch
from hybridflow.controller.backends import Backend, settle
from hybridflow.controller.errors import WorkerDiedError, WorkerError
from hybridflow.controller.logs import prefix, prefixed_output
from hybridflow.controller.runtime import WorkerRuntime, ensure_single_process_group


def _detach(value: object) -> object:
    """A Batch argument gets fresh key dicts, so a worker adding or popping keys leaves the caller's intact."""
    return value.select(*value.keys()) if isinstance(value, Batch) else value


class InlineBackend(Backend):
    """Runs calls in the controller: blocking calls in the caller's thread, submits in a helper thread."""

    def start(self) -> None:
        ensure_single_process_group(self.spec.device_type)
        gpu = self.pool.gpu_ids[0] if self.pool.gpu_ids else 0
        device = torch.device(f"cuda:{gpu}") if self.spec.device_type == "cuda" else torch.device("cpu")
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"hybridflow-{self.spec.role}")
        self._closed = False
        try:
            with prefixed_output(prefix(self.spec.role, 0)):
                self.runtime: WorkerRuntime | None = WorkerRuntime(self.spec, rank=0, local_rank=0, device=device)
        except Exception as exc:
            raise WorkerError(self.spec.role, 0, "__init__", traceback.format_exc()) from exc

    def encode(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments are passed by reference; Batches get fresh key dicts."""
        return tuple(_detach(a) for a in args), {k: _detach(v) for k, v in kwargs.items()}

    def _run(self, future: Future, path: str, encoded: tuple[tuple, dict]) -> None:
        runtime = self.runtime
        if runtime is None:
            raise RuntimeError(f"group '{self.spec.role}' is shut down: {path} cannot run")
        with self._lock, prefixed_output(prefix(self.spec.role, 0)):
            reply = runtime.call(path, *encoded)
        settle(future, reply, self.spec.role, 0, path)

    def submit(self, rank: int, path: str, encoded: tuple[tuple, dict], blocking: bool) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(WorkerDiedError(self.spec.role, rank, "the group was shut down"))
        elif blocking:
            self._run(future, path, encoded)
        else:
            self._executor.submit(self._run, future, path, encoded)
        return future

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True)
        self.runtime = None
