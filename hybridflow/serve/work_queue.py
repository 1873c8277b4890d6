"""The service's one worker thread and its queue, which runs compatible waiting requests as one batch.

The model and the engine are not thread-safe, so every long operation runs on one thread, in arrival order.
A `Job` may carry a batch `key`: when the worker takes it, the later waiting jobs with the same key join it and
run as one call (`run(requests) -> one result or exception per request`), e.g. two clients' sample requests on
the same weights become one engine batch. A later job joins only if no job between them touches the same
`resource` under another key (a forward_backward does not join one queued before an optim_step of its model).
`submit` returns a `concurrent.futures.Future` that holds the job's result, or its exception.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

Outcome = Any  # a result, or the exception raised for that request


@dataclass
class Job:
    """One request: `run([request, ...])` gives one outcome per request; jobs of equal `key` may share a run."""

    run: Callable[[list[Any]], list[Outcome]]
    request: Any
    key: Hashable | None = None
    resource: Hashable | None = None
    future: Future = field(default_factory=Future)


class WorkQueue:
    """A worker thread taking jobs in order, batching those of one key (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._ready = threading.Condition()
        self._closed = False
        self.batches: list[int] = []  # the size of each batch run, in order (for tests and logs)
        self._thread = threading.Thread(target=self._work, name="tinker-service", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._ready:
            if self._closed:
                raise RuntimeError("the service is shutting down")
            self._jobs.append(job)
            self._ready.notify()
        return job.future

    def waiting(self) -> int:
        """Jobs not yet taken by the worker."""
        with self._ready:
            return len(self._jobs)

    def close(self) -> None:
        """Stop taking jobs; those still waiting fail with a `RuntimeError`."""
        with self._ready:
            self._closed = True
            for job in self._jobs:
                job.future.set_exception(RuntimeError("the service shut down before running this request"))
            self._jobs.clear()
            self._ready.notify()

    def _take(self) -> list[Job] | None:
        with self._ready:
            while not self._jobs and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            first = self._jobs.pop(0)
            batch = [first]
            if first.key is not None:
                for job in list(self._jobs):
                    if job.key == first.key:
                        batch.append(job)
                        self._jobs.remove(job)
                    elif first.resource is not None and job.resource == first.resource:
                        break
            return batch

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            self.batches.append(len(batch))
            try:
                outcomes = batch[0].run([job.request for job in batch])
            except Exception as e:  # the whole batch failed: each request gets the error
                outcomes = [e] * len(batch)
            for job, outcome in zip(batch, outcomes):
                if isinstance(outcome, BaseException):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result(outcome)
