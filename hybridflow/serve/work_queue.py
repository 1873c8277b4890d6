"""The service's one worker thread and its queue, which runs compatible waiting requests as one batch.

The model and the engine are not thread-safe, so every long operation runs on one thread, in arrival order.
A `Job` may carry a batch `key`: when the worker takes it, the later waiting jobs with the same key join it and
run as one call (`run(requests) -> one result or exception per request`), e.g. two clients' sample requests on
the same weights become one engine batch. A later job joins only if no job between them touches the same
`resource` under another key (a forward_backward does not join one queued before an optim_step of its model).
`submit` returns a `concurrent.futures.Future` that holds the job's result, or its exception.

A `stream` job's run takes the `Batch` itself instead: it answers each request as soon as it is done
(`Batch.answer`), and takes in the jobs of its key that arrive while it runs (`Batch.join`, by the same rule), so
sample requests that come a moment after an engine batch started join it between two decode steps instead of
waiting for its end.
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
    """One request: `run([request, ...])` gives one outcome per request (a `stream` job: `run(batch)` answers them
    itself); jobs of equal `key` may share a run."""

    run: Callable[[Any], Any]
    request: Any
    key: Hashable | None = None
    resource: Hashable | None = None
    stream: bool = False
    future: Future = field(default_factory=Future)


class Batch:
    """The jobs one run serves: those taken together, then (a `stream` run) those that joined while it ran."""

    def __init__(self, queue: WorkQueue, jobs: list[Job]) -> None:
        self._queue = queue
        self.jobs = jobs

    @property
    def requests(self) -> list[Any]:
        return [job.request for job in self.jobs]

    def join(self) -> list[int]:
        """Take in the waiting jobs that may join this batch now; the indices of their requests in `requests`."""
        first = len(self.jobs)
        self.jobs += self._queue.joining(self.jobs[0])
        return list(range(first, len(self.jobs)))

    def answer(self, index: int, outcome: Outcome) -> None:
        """Resolve request `index`'s future with `outcome` (an exception fails it); a request answered stays so."""
        future = self.jobs[index].future
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


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
            return [first] + self._joinable(first)

    def joining(self, first: Job) -> list[Job]:
        """The waiting jobs that join `first`'s running batch now (removed from the queue)."""
        with self._ready:
            return [] if self._closed else self._joinable(first)

    def _joinable(self, first: Job) -> list[Job]:
        """Waiting jobs of `first`'s key, in order, up to one touching its resource under another key; removed
        from the queue. The caller holds the lock."""
        batch: list[Job] = []
        if first.key is None:
            return batch
        for job in list(self._jobs):
            if job.key == first.key:
                batch.append(job)
                self._jobs.remove(job)
            elif first.resource is not None and job.resource == first.resource:
                break
        return batch

    def _work(self) -> None:
        while (jobs := self._take()) is not None:
            batch = Batch(self, jobs)
            try:
                if jobs[0].stream:
                    jobs[0].run(batch)
                    unanswered: list[Outcome] = [RuntimeError("the server's batch ended without answering this "
                                                              "request")] * len(batch.jobs)
                else:
                    unanswered = jobs[0].run(batch.requests)
            except Exception as e:  # the whole batch failed: each request not yet answered gets the error
                unanswered = [e] * len(batch.jobs)
            self.batches.append(len(batch.jobs))
            for index, outcome in enumerate(unanswered):
                batch.answer(index, outcome)
