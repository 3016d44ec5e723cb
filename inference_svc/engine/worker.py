"""One compute thread per process: every model's work (loading, requests, warmup) runs there.

Why one thread for all models, not one per model: torch's CPU kernels run their parallel
regions on OpenMP (libgomp). Each long-lived thread that enters parallel regions gets its own
team of OpenMP threads; with two such threads alive on a machine with few cores, libgomp
throttles its spin-waiting and every parallel region pays a futex wake-up. Measured on 2
cores: a 576x1536 matrix-vector product takes 35 us on the only compute thread and 120-150
us on a second one (a SmolLM2 decode step: 30 ms against 53 ms). One compute thread keeps
the whole machine's cores for each forward; the models take turns, one batch (Embed) or one
scheduler iteration (Generate) at a time, which is what two models on the same cores would
do anyway.

Everything on that thread runs under ``torch.inference_mode()``, requests and warmup
alike, so the tensors a warmup step compiles with are of the same kind (inference tensors)
as a request's: a compiled graph guards on that.

Model work never runs on the event loop, so health checks answer while a forward pass
runs; and requests and warmup steps of one model never overlap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

from inference_svc.errors import ResourceExhausted

log = logging.getLogger(__name__)
J = TypeVar("J")
T = TypeVar("T")


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                self.future.set_result(self.fn())
        except BaseException as exc:
            self.future.set_exception(exc)


class ComputeThread:
    """The thread that runs every model's work; workers take turns (``poll``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: list[ModelWorker[Any]] = []
        self._calls: queue.Queue[_Call] = queue.Queue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, worker: ModelWorker[Any]) -> None:
        with self._lock:
            self._workers.append(worker)
            self._start()

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
            self._thread.start()

    def unregister(self, worker: ModelWorker[Any]) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)

    def wake(self) -> None:
        self._wake.set()

    def run(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the compute thread (e.g. loading a model), between two turns."""
        with self._lock:
            self._start()
        call = _Call(fn)
        self._calls.put(call)
        self.wake()
        return call.future

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                self._wake.clear()  # a wake() from here on makes the wait below return
                busy = False
                while not self._calls.empty():
                    self._calls.get_nowait().run()
                    busy = True
                with self._lock:
                    workers = list(self._workers)
                for worker in workers:
                    try:
                        busy |= worker.poll()
                    except Exception:  # a bug in a worker must not stop the others
                        log.exception("model %s: worker turn failed", worker.name)
                if not busy:
                    holds = [h for w in workers if (h := w.holding_for()) is not None]
                    self._wake.wait(min(holds) if holds else None)


COMPUTE = ComputeThread()


class ModelWorker(Generic[J]):
    """A queue of jobs (batched by ``run_batch``) and calls (run alone, in order), served in
    turns on the compute thread."""

    def __init__(self, name: str, max_queue: int, batch_wait_s: float = 0.0) -> None:
        self.name = name
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s  # see _hold_after; 0: a batch never waits
        self._hold: tuple[int, float] | None = None  # (rows to wait for, until when)
        self._queue: queue.Queue[J | _Call | None] = queue.Queue()
        self._pending: list[J] = []
        self._stopped = threading.Event()
        # What metrics read at scrape time: batches run by their rows, rows running now.
        self.batches_by_rows: Counter[int] = Counter()
        self.rows_in_use = 0
        COMPUTE.register(self)

    def submit(self, job: J) -> None:
        if self.depth() >= self.max_queue:
            raise ResourceExhausted(
                f"model {self.name}: {self.max_queue} requests already queued; retry later"
            )
        self._queue.put(job)
        COMPUTE.wake()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the compute thread, between this model's batches."""
        item = _Call(fn)
        self._queue.put(item)
        COMPUTE.wake()
        return item.future

    def stop(self) -> None:
        self._queue.put(None)
        COMPUTE.wake()
        self._stopped.wait(timeout=30)

    def depth(self) -> int:
        """Requests waiting for the model (queued, or held back from a full batch)."""
        return self._queue.qsize() + len(self._pending)

    # -- to implement ---------------------------------------------------------
    def batch_size_of(self, job: J) -> int:
        return 1

    def capacity(self) -> int:
        raise NotImplementedError

    def run_batch(self, jobs: list[J]) -> None:
        raise NotImplementedError

    def fail(self, job: J, exc: BaseException) -> None:
        raise NotImplementedError

    # -- one turn on the compute thread ---------------------------------------------
    def holding_for(self) -> float | None:
        """Seconds left of a hold while jobs wait held back (see ``_hold_after``), else None."""
        if self._hold is None or not self._queued_rows():
            return None
        left = self._hold[1] - time.monotonic()
        return left if left > 0 else None

    def _holding(self) -> bool:
        """Whether queued jobs are held back for more (a call or a stop is never held)."""
        if self._hold is None:
            return False
        rows, until = self._hold
        queued = self._queued_rows()
        if queued < 0 or queued >= rows or time.monotonic() >= until:
            self._hold = None
            return False
        return True

    def _hold_after(self, jobs: list[J], seconds: float) -> None:
        """Concurrent callers in a closed loop fall into cohorts: while one batch runs, the
        calls that arrive queue up, and when it ends they start at once, before the callers
        just answered are back; the load settles into two half-size batches taking turns
        (measured: 16 rows a batch with 32 clients, --embed-max-batch 32). So after a batch
        of several calls, the next one waits until as many rows are queued as that batch
        ran plus those already waiting, or ``batch_wait_s``, or as long as that batch took,
        whichever comes first. A lone call never waits: after a batch of one call, or when
        the hold has run out (an idle service), the next call starts as it arrives."""
        if self.batch_wait_s <= 0 or len(jobs) < 2:
            return
        ran = sum(self.batch_size_of(job) for job in jobs)
        rows = min(ran + self._queued_rows(), self.capacity())
        self._hold = (rows, time.monotonic() + min(self.batch_wait_s, seconds))

    def _queued_rows(self) -> int:
        """Rows of the jobs waiting; -1 when a call or a stop waits among them."""
        with self._queue.mutex:
            items = [*self._pending, *self._queue.queue]
        rows = 0
        for item in items:
            if item is None or isinstance(item, _Call):
                return -1
            rows += self.batch_size_of(item)
        return rows

    def poll(self) -> bool:
        """Run one batch or one call, if any is waiting; False when there was nothing."""
        if self._holding():
            return False
        if self._pending:
            item: J | _Call | None = self._pending.pop(0)
        else:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
        if item is None:
            self._retire()
            return True
        if isinstance(item, _Call):
            item.run()
            return True
        jobs, call, stopping = self._take_batch(item)
        start = time.perf_counter()
        self._run_jobs(jobs)
        self._hold_after(jobs, time.perf_counter() - start)
        if call is not None:
            call.run()
        if stopping:
            self._retire()
        return True

    def _retire(self) -> None:
        COMPUTE.unregister(self)
        self._stopped.set()

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
