"""The local backend: one process per rank, a gloo/NCCL process group per worker group, calls over pipes.

A CPU group's processes are forked from a fork server that has imported torch, transformers and hybridflow once; a
GPU group's are spawned (`process_start` says why, and what a forked process is handed that a spawned one
inherits: its environment). Each process talks to the controller over one duplex pipe: the controller's sender
thread writes pickled calls, its reader thread matches replies to futures by call id and notices a dead process
(the pipe closes) at once. Workers exit when the controller goes away (a watchdog thread), on `shutdown()`, and
at controller exit (atexit, see `group.py`). They ignore SIGINT and SIGTERM: a Ctrl-C, `scancel` or `systemctl
stop` signals the whole process group, and the controller, which gets the signal too, decides how the run stops
(`hybridflow.trainer.step_loop`); a worker killed mid-step would lose it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import sys
import threading
import time
import traceback
import uuid
from typing import Any
from concurrent.futures import Future

import torch
import torch.distributed as dist

from hybridflow.controller.backends import Backend, settle, wait_all
from hybridflow.controller.backends.process_start import environ, start_context
from hybridflow.controller.errors import WorkerDiedError, describe_exit
from hybridflow.controller.liveness import Liveness, fail
from hybridflow.controller.logs import forward_output, log_server, mark_synced, prefix
from hybridflow.controller.runtime import Reply, WorkerRuntime, join_process_group, load_spec
from hybridflow.utils.stop_signals import held_signals, ignore_stop_signals

GRACEFUL_EXIT_S = 5.0


def _exists(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number
        return True
    return True


def _watch_controller(controller_pid: int) -> None:
    """Ends this worker as soon as the controller process is gone (no orphans).

    The parent is the controller (spawned) or the fork server, which exits when the controller does: either way it
    changes at the controller's death, even while the controller is a zombie nobody has reaped. The controller's pid
    is looked at too, for a server gone before this thread first asked for its parent."""
    parent = os.getppid()
    while os.getppid() == parent and _exists(controller_pid):
        time.sleep(0.5)
    os._exit(1)


def _send(conn, header: object, payload: bytes) -> None:
    """One message = two frames: a small pickled header, then the (large) payload bytes."""
    conn.send_bytes(pickle.dumps(header))
    conn.send_bytes(payload)


def _dump_reply(reply: Reply) -> bytes:
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a result that cannot be pickled is the method's error
        return pickle.dumps(("error", traceback.format_exc()))


def _worker_main(
    conn, sys_path: list[str], blob: bytes, rank: int, store_port: int, log_addr: tuple, log_key: str,
    controller_pid: int, env: dict[str, str],
) -> None:
    """Entry point of a worker process: its environment, output forwarding, process group, worker, then the call
    loop. `env` is the whole environment it should have: a process forked from the fork server has the server's.

    The OpenMP thread count, which torch read from the server's environment at import, needs nothing here: a CPU
    group's ranks set theirs in `join_process_group`, and GPU groups are spawned with `env` in place."""
    os.environ.clear()
    os.environ.update(env)
    ignore_stop_signals()
    threading.Thread(target=_watch_controller, args=(controller_pid,), daemon=True).start()
    spec = load_spec(sys_path, blob)
    forward_output(log_addr, prefix(spec.role, rank), log_key)
    try:
        join_process_group(spec, rank, ("127.0.0.1", store_port))
        device = torch.device(f"cuda:{rank}") if spec.device_type == "cuda" else torch.device("cpu")
        runtime = WorkerRuntime(spec, rank, rank, device)
    except BaseException:  # noqa: BLE001 - reported to the controller as a WorkerError
        mark_synced(0)
        _send(conn, 0, _dump_reply(("error", traceback.format_exc())))
        return
    mark_synced(0)
    _send(conn, 0, _dump_reply(("ok", os.getpid())))
    while True:
        try:
            header = conn.recv_bytes()
            if not header:
                break
            call_id, path = pickle.loads(header)
            payload = conn.recv_bytes()
        except EOFError:
            break
        try:
            args, kwargs = pickle.loads(payload)
        except BaseException:  # noqa: BLE001 - e.g. an argument class this process cannot import
            reply: Reply = ("error", traceback.format_exc())
        else:
            reply = runtime.call(path, args, kwargs)
        mark_synced(call_id)
        _send(conn, call_id, _dump_reply(reply))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def _visible_devices(gpu_ids: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for the pool's GPUs, which index the controller's own visible list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(max(gpu_ids) + 1)]
    return ",".join(names[g] for g in gpu_ids)


class LocalBackend(Backend):
    """A group of `world_size` worker processes on this machine."""

    def start(self) -> None:
        spec = self.spec
        self._ids = itertools.count(1)
        self._uid = uuid.uuid4().hex
        self._pending: list[dict[int, tuple[Future, str]]] = [{} for _ in range(self.world_size)]
        self._dead: dict[int, Exception] = {}
        self._closing = False
        self._lock = threading.Lock()
        self._liveness: Liveness | None = None
        self._serving = False  # the pipes' reader and writer threads run: a worker can be asked to exit
        store = dist.TCPStore("127.0.0.1", 0, spec.world_size + 1, is_master=True, wait_for_workers=False)
        self._store: dist.TCPStore | None = store
        env = dict(self.env)
        if spec.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = _visible_devices(self.pool.gpu_ids[: self.world_size])
        self.procs: list[Any] = []  # the started processes
        self._conns: list[Any] = []  # their pipe ends
        self._outboxes: list[Any] = []  # their send queues
        # a stop signal can land anywhere in here (after each process start, `held_signals` delivers one that
        # arrived meanwhile): the processes started so far are shut down, or the interpreter's exit would wait for
        # them (multiprocessing joins its children) while they wait for work that never comes
        try:
            ctx = start_context(spec.device_type)
            # a spawned interpreter reads CUDA_VISIBLE_DEVICES at exec, before `_worker_main` puts `env` in place
            spawned = ctx.get_start_method() == "spawn"
            with environ(env) if spawned else contextlib.nullcontext():
                ready = [self._spawn(ctx, rank, {**os.environ, **env}) for rank in range(self.world_size)]
            for rank in range(self.world_size):
                for loop, tag in ((self._read_loop, "rx"), (self._send_loop, "tx")):
                    threading.Thread(target=loop, args=(rank,), daemon=True,
                                     name=f"hf-{spec.role}-{rank}-{tag}").start()
            self._serving = True
            if self.worker_timeout_s:
                self._liveness = Liveness(spec.role, log_server(), [self._log_key(r) for r in range(self.world_size)],
                                          lambda r: f"pid {self.procs[r].pid}", self.worker_timeout_s, self._give_up)
            wait_all(ready)
        except BaseException:
            self.shutdown()
            raise

    def _give_up(self, rank: int, error: Exception) -> None:
        """`Liveness` found the rank silent: later calls to it fail at once, and shutdown kills it."""
        with self._lock:
            self._dead.setdefault(rank, error)

    def _log_key(self, rank: int) -> str:
        return f"{self._uid}-{rank}"

    def _spawn(self, ctx: Any, rank: int, env: dict[str, str]) -> Future:
        """Starts rank `rank`'s process in multiprocessing context `ctx`, with environment `env`; returns the Future
        of its start-up reply (its pid)."""
        store = self._store
        if store is None:
            raise RuntimeError(f"group '{self.spec.role}' is shut down: rank {rank} cannot start")
        parent, child = ctx.Pipe(duplex=True)
        sys_path, blob = self.spec.dumps()
        proc = ctx.Process(
            target=_worker_main,
            args=(
                child, sys_path, blob, rank, store.port, log_server().address, self._log_key(rank),
                os.getpid(), env,
            ),
            name=f"hybridflow-{self.spec.role}-{rank}",
        )
        # a stop now would leave the new process without its work, printing a traceback; the start may wait seconds
        # for the fork server's imports: a signal meanwhile is answered at the block's end
        with held_signals():
            proc.start()
            child.close()  # the pipe now closes as soon as the worker dies
            # recorded before a held signal is delivered (at the block's end), so that shutdown stops it
            self.procs.append(proc)
            self._conns.append(parent)
            self._outboxes.append(queue.SimpleQueue())
        ready: Future = Future()
        self._pending[rank][0] = (ready, "__init__")
        return ready

    def _send_loop(self, rank: int) -> None:
        """Writes queued calls to the pipe, so `submit` never blocks on a busy worker."""
        conn, outbox = self._conns[rank], self._outboxes[rank]
        while True:
            message = outbox.get()
            try:
                if message is None:
                    conn.send_bytes(b"")
                    return
                _send(conn, *message)
            except OSError:  # the process is gone; the reader reports it
                return

    def _read_loop(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                call_id = pickle.loads(conn.recv_bytes())
                payload = conn.recv_bytes()
            except Exception:  # noqa: BLE001 - EOF (the process died) or a broken stream alike
                break
            with self._lock:
                future, path = self._pending[rank].pop(call_id, (None, ""))
            if future is None:  # the rank was given up as unresponsive, then answered after all
                continue
            log_server().wait_synced(self._log_key(rank), call_id)
            try:
                reply = pickle.loads(payload)
            except Exception:  # noqa: BLE001 - e.g. a result class the controller cannot import
                reply = ("error", "the controller could not unpickle the result:\n" + traceback.format_exc())
            settle(future, reply, self.spec.role, rank, path)
        self._on_exit(rank)

    def _on_exit(self, rank: int) -> None:
        """The pipe closed: fail this rank's pending calls (and later ones) unless we are closing."""
        proc = self.procs[rank]
        proc.join(timeout=3.0)
        how = "the group was shut down" if self._closing else describe_exit(proc.exitcode)
        error = WorkerDiedError(self.spec.role, rank, f"pid {proc.pid}, {how}")
        with self._lock:
            self._dead.setdefault(rank, error)
            pending, self._pending[rank] = self._pending[rank], {}
        for future, _ in pending.values():
            fail(future, error)

    def submit(self, rank: int, path: str, encoded: bytes, blocking: bool) -> Future:
        future: Future = Future()
        with self._lock:
            if rank in self._dead:
                future.set_exception(self._dead[rank])
                return future
            call_id = next(self._ids)
            self._pending[rank][call_id] = (future, path)
        if self._liveness is not None:
            self._liveness.track(rank, future, path)
        self._outboxes[rank].put(((call_id, path), encoded))
        return future

    def shutdown(self) -> None:
        """Asks every live worker to exit, then kills whoever remains."""
        self._closing = True
        if self._liveness is not None:
            self._liveness.close()
        healthy = not self._dead and self._serving  # else no worker can be asked: kill at once
        for outbox in self._outboxes:
            outbox.put(None)
        deadline = time.monotonic() + (GRACEFUL_EXIT_S if healthy else 0.5)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in self.procs if p.is_alive()]  # workers ignore SIGTERM: kill them
        for proc in alive:
            proc.kill()
        for proc in alive:
            proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._store = None
