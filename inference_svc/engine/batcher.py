"""A batcher: jobs taken from an inbox in batches of up to ``capacity`` rows, one batch a
turn on the compute thread (Embed). Calls run alone, in order, between batches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from inference_svc.engine.compute import Call, ComputeThread
from inference_svc.engine.inbox import Inbox, Stop
from inference_svc.errors import Unavailable

log = logging.getLogger(__name__)
J = TypeVar("J")


class Batcher(Generic[J]):
    """``run_batch(jobs)`` answers each job (or raises: then ``fail(job, exc)`` answers each);
    ``rows_of(job)`` is the batch rows a job takes; a batch never exceeds ``capacity`` rows."""

    def __init__(
        self,
        inbox: Inbox[J],
        run_batch: Callable[[list[J]], None],
        fail: Callable[[J, BaseException], None],
        capacity: int,
        rows_of: Callable[[J], int] = lambda job: 1,
        batch_wait_s: float = 0.0,
    ) -> None:
        self.name, self.inbox = inbox.name, inbox
        self.run_batch = run_batch
        self.fail = fail
        self.capacity = capacity
        self.rows_of = rows_of
        self.batch_wait_s = batch_wait_s  # see _hold_after; 0: a batch never waits
        self._hold: tuple[int, float] | None = None  # (rows to wait for, until when)
        self._pending: list[J] = []  # taken out of the inbox, did not fit the last batch
        inbox.waiting = lambda: len(self._pending)
        inbox.compute.register(self)

    @property
    def compute(self) -> ComputeThread:
        return self.inbox.compute

    # -- the batch hold ---------------------------------------------------------------
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
        ran = sum(self.rows_of(job) for job in jobs)
        rows = min(ran + self._queued_rows(), self.capacity)
        self._hold = (rows, time.monotonic() + min(self.batch_wait_s, seconds))

    def _queued_rows(self) -> int:
        """Rows of the jobs waiting; -1 when a call or a stop waits among them."""
        rows = 0
        for item in [*self._pending, *self.inbox.snapshot()]:
            if isinstance(item, Call | Stop):
                return -1
            rows += self.rows_of(item)
        return rows

    # -- one turn ---------------------------------------------------------------------
    def poll(self) -> bool:
        """Run one batch or one call, if any is waiting; False when there was nothing."""
        if self._holding():
            return False
        item = self._pending.pop(0) if self._pending else self.inbox.get()
        if item is None:
            return False
        if isinstance(item, Stop):
            self._retire()
            return True
        if isinstance(item, Call):
            item.run()
            return True
        jobs, after = self._take_batch(item)
        start = time.perf_counter()
        self._run_jobs(jobs)
        self._hold_after(jobs, time.perf_counter() - start)
        if isinstance(after, Call):
            after.run()
        elif isinstance(after, Stop):
            self._retire()
        return True

    def _retire(self) -> None:
        """Stop: every job still waiting is answered UNAVAILABLE (none is left hanging)."""
        stopped = Unavailable(f"model {self.name}: the service is stopping")
        for item in [*self._pending, *iter(self.inbox.get, None)]:
            if isinstance(item, Call):
                item.future.cancel()
            elif not isinstance(item, Stop):
                self.fail(item, stopped)
        self._pending.clear()
        self.compute.unregister(self)
        self.inbox.stopped.set()

    def _take_batch(self, first: J) -> tuple[list[J], Call | Stop | None]:
        jobs, used = [first], self.rows_of(first)
        while True:
            item = self.inbox.get()
            if item is None or isinstance(item, Call | Stop):
                return jobs, item
            if used + self.rows_of(item) > self.capacity:
                self._pending.append(item)
                return jobs, None
            jobs.append(item)
            used += self.rows_of(item)

    def _run_jobs(self, jobs: list[J]) -> None:
        rows = sum(self.rows_of(job) for job in jobs)
        self.inbox.batches_by_rows[rows] += 1
        self.inbox.rows_in_use = rows
        try:
            self.run_batch(jobs)
        except Exception as exc:  # a real fault: every job of the batch gets it
            log.exception("model %s: batch of %d failed", self.name, len(jobs))
            for job in jobs:
                self.fail(job, exc)
        finally:
            self.inbox.rows_in_use = 0
