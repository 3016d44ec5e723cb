"""Counts torch.compile events and says which model, compile site and shapes caused each.

Before SERVING, compiles are the point of warmup: each warmup step reports how
many it caused. After SERVING, any compile is a cold path that reached a
request: it is counted as *late*, logged with its cause, and handed to the
``on_late`` hook (which, under ``--on-late-compile fail``, fails health).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)


class Origin(enum.Enum):
    """Who ran a compiled function: a client's request or a warmup step."""

    REQUEST = "request"
    WARMUP = "warmup"


@dataclass(frozen=True)
class CompileContext:
    model: str
    # The compiled function and who ran it, e.g. "prefill/request", "sampler/greedy".
    site: str
    shapes: str


@dataclass(frozen=True)
class LateCompile:
    context: CompileContext
    compile_id: str

    def describe(self) -> str:
        c = self.context
        return f"model={c.model} site={c.site} shapes={c.shapes} compile_id={self.compile_id}"


class CompileMonitor:
    """Hooks torch._dynamo's compile-start callback for the life of the service."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._serving = False
        self.total = 0
        self.late = 0
        self.late_by_model: Counter[str] = Counter()
        self.on_late: Callable[[LateCompile], None] | None = None

    def install(self) -> None:
        """Register the hook (again after a ``torch._dynamo.reset()``, which drops it)."""
        import torch._dynamo.callback as cb

        if self._on_start not in cb.callback_handler.start_callbacks:
            cb.callback_handler.register_start_callback(self._on_start)

    def close(self) -> None:
        import torch._dynamo.callback as cb

        if self._on_start in cb.callback_handler.start_callbacks:
            cb.callback_handler.remove_start_callback(self._on_start)

    def mark_serving(self) -> None:
        with self._lock:
            self._serving = True

    @contextmanager
    def context(self, model: str, site: str, shapes: str) -> Iterator[None]:
        """Attribute compiles in this thread, inside the block, to this cause."""
        self.install()  # cheap; re-registers after a torch._dynamo.reset() dropped the hook
        prev = getattr(self._local, "ctx", None)
        self._local.ctx = CompileContext(model, site, shapes)
        try:
            yield
        finally:
            self._local.ctx = prev

    @contextmanager
    def counting(self) -> Iterator[list[int]]:
        """Count the compiles this thread causes inside the block: ``box[0]``."""
        box = [0]
        prev = getattr(self._local, "box", None)
        self._local.box = box
        try:
            yield box
        finally:
            self._local.box = prev
            if prev is not None:
                prev[0] += box[0]

    def _on_start(self, args: object) -> None:
        self.record(str(getattr(args, "compile_id", "?")))

    def record(self, compile_id: str) -> None:
        """One compile in this thread: Dynamo's (the hook) or an AOTInductor package built
        by the service itself (models/aoti.py), counted and judged alike."""
        ctx = getattr(self._local, "ctx", None) or CompileContext("?", "?", "?")
        box = getattr(self._local, "box", None)
        if box is not None:
            box[0] += 1
        with self._lock:
            self.total += 1
            late = self._serving
            if late:
                self.late += 1
                self.late_by_model[ctx.model] += 1
        event = LateCompile(ctx, compile_id)
        if not late:
            log.debug("compile event %s", event.describe())
            return
        log.warning("late compile after SERVING: %s", event.describe())
        if self.on_late is not None:
            self.on_late(event)
