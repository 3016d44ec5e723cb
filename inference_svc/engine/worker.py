"""One thread per model: all of a model's work (requests and warmup) runs there.

Everything on that thread runs under ``torch.inference_mode()``, requests and
warmup alike, so the tensors a warmup step compiles with are of the same kind
(inference tensors) as a request's: a compiled graph guards on that.

Model work never runs on the event loop, so health checks answer while a
forward pass runs; and requests and warmup steps of one model never overlap.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

from inference_svc.errors import ResourceExhausted

log = logging.getLogger(__name__)
J = TypeVar("J")


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()


class ModelWorker(Generic[J]):
    """A queue of jobs (batched by ``run_batch``) and calls (run alone, in order)."""

    def __init__(self, name: str, max_queue: int) -> None:
        self.name = name
        self.max_queue = max_queue
        self._queue: queue.Queue[J | _Call | None] = queue.Queue()
        self._pending: list[J] = []
        # What metrics read at scrape time: batches run by their rows, rows running now.
        self.batches_by_rows: Counter[int] = Counter()
        self.rows_in_use = 0
        self._thread = threading.Thread(target=self._loop, name=f"model-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: J) -> None:
        if self.depth() >= self.max_queue:
            raise ResourceExhausted(
                f"model {self.name}: {self.max_queue} requests already queued; retry later"
            )
        self._queue.put(job)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on this model's thread, between batches."""
        item = _Call(fn)
        self._queue.put(item)
        return item.future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # -- to implement ---------------------------------------------------------
    def batch_size_of(self, job: J) -> int:
        return 1

    def capacity(self) -> int:
        raise NotImplementedError

    def run_batch(self, jobs: list[J]) -> None:
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------------
    def _take_batch(self, first: J) -> tuple[list[J], _Call | None, bool]:
        jobs, used, limit = [first], self.batch_size_of(first), self.capacity()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return jobs, None, False
            if item is None:
                return jobs, None, True
            if isinstance(item, _Call):
                return jobs, item, False
            if used + self.batch_size_of(item) > limit:
                self._pending.append(item)
                return jobs, None, False
            jobs.append(item)
            used += self.batch_size_of(item)

    def _next(self) -> J | _Call | None:
        if self._pending:
            return self._pending.pop(0)
        return self._queue.get()

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            item = self._next()
            if item is None:
                break
            call = None
            if isinstance(item, _Call):
                call = item
            else:
                jobs, call, stopping = self._take_batch(item)
                self._run_jobs(jobs)
            if call is not None:
                self._run_call(call)

    def depth(self) -> int:
        """Requests waiting for the model thread (queued, or held back from a full batch)."""
        return self._queue.qsize() + len(self._pending)

    def _run_jobs(self, jobs: list[J]) -> None:
        rows = sum(self.batch_size_of(job) for job in jobs)
        self.batches_by_rows[rows] += 1
        self.rows_in_use = rows
        try:
            with torch.inference_mode():
                self.run_batch(jobs)
        except Exception as exc:  # a real fault: every job of the batch gets it
            log.exception("model %s: batch of %d failed", self.name, len(jobs))
            for job in jobs:
                self.fail(job, exc)
        finally:
            self.rows_in_use = 0

    @staticmethod
    def _run_call(call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                call.future.set_result(call.fn())
        except BaseException as exc:
            call.future.set_exception(exc)

    def fail(self, job: J, exc: BaseException) -> None:
        raise NotImplementedError
