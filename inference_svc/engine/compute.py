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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Turn(Protocol):
    """Anything that takes turns on the compute thread (a model's batcher or loop)."""

    name: str

    def poll(self) -> bool:
        """Do one unit of work (a batch, one scheduler iteration, a call); False if idle."""

    def holding_for(self) -> float | None:
        """Seconds until work held back on purpose is due, or None."""


class Call:
    """A function run once on the compute thread, its result in ``future``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:  # on the compute thread: under its inference_mode
            self.future.set_result(self.fn())
        except BaseException as exc:
            self.future.set_exception(exc)


class ComputeThread:
    """The thread that runs every model's work; registered turns take turns (``poll``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: list[Turn] = []
        self._calls: queue.Queue[Call] = queue.Queue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, turn: Turn) -> None:
        with self._lock:
            self._turns.append(turn)
            self._start()

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
            self._thread.start()

    def unregister(self, turn: Turn) -> None:
        with self._lock:
            if turn in self._turns:
                self._turns.remove(turn)

    def wake(self) -> None:
        self._wake.set()

    def run(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the compute thread (e.g. loading a model), between two turns."""
        with self._lock:
            self._start()
        call = Call(fn)
        self._calls.put(call)
        self.wake()
        return call.future

    def _loop(self) -> None:
        import torch  # here, not at import: the inbox and the scheduler stay torch-free

        with torch.inference_mode():
            while True:
                self._wake.clear()  # a wake() from here on makes the wait below return
                busy = False
                while not self._calls.empty():
                    self._calls.get_nowait().run()
                    busy = True
                with self._lock:
                    turns = list(self._turns)
                for turn in turns:
                    try:
                        busy |= turn.poll()
                    except Exception:  # a bug in one model's turn must not stop the others
                        log.exception("model %s: turn failed", turn.name)
                if not busy:
                    holds = [h for t in turns if (h := t.holding_for()) is not None]
                    self._wake.wait(min(holds) if holds else None)
