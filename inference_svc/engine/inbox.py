"""A model's inbox: requests, calls (warmup steps, run alone and in order) and a stop,
put by the event loop's threads and taken by the model's turn on the compute thread; and
what the metrics read of it."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from inference_svc.engine.compute import Call, ComputeThread
from inference_svc.errors import ResourceExhausted

J = TypeVar("J")


class Stop:
    """The last item a turn takes: it fails what it holds and retires."""


STOP = Stop()


class Inbox(Generic[J]):
    def __init__(self, name: str, max_queue: int, compute: ComputeThread) -> None:
        self.name = name
        self.max_queue = max_queue
        self.compute = compute
        self._queue: queue.Queue[J | Call | Stop] = queue.Queue()
        self.stopped = threading.Event()
        # Jobs the turn took out but has not started (held back, or waiting for a row).
        self.waiting: Callable[[], int] = lambda: 0
        # What metrics read at scrape time: batches run by their rows, rows running now.
        self.batches_by_rows: Counter[int] = Counter()
        self.chunks_by_tokens: Counter[int] = Counter()  # Generate: prefill chunks, padded width
        self.rows_in_use = 0

    def submit(self, job: J) -> None:
        if self.depth() >= self.max_queue:
            raise ResourceExhausted(
                f"model {self.name}: {self.max_queue} requests already queued; retry later"
            )
        self._queue.put(job)
        self.compute.wake()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the compute thread, between this model's batches or steps."""
        item = Call(fn)
        self._queue.put(item)
        self.compute.wake()
        return item.future

    def stop(self, timeout: float = 30) -> None:
        """Ask the turn to fail what it holds and retire; wait until it has."""
        self._queue.put(STOP)
        self.compute.wake()
        self.stopped.wait(timeout=timeout)

    def depth(self) -> int:
        """Requests waiting for the model (queued, or taken out and not started)."""
        return self._queue.qsize() + self.waiting()

    def get(self) -> J | Call | Stop | None:
        """The next item, or None when the inbox is empty."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def snapshot(self) -> list[J | Call | Stop]:
        """What is queued now, in order (nothing is taken)."""
        with self._queue.mutex:
            return list(self._queue.queue)
