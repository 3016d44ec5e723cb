"""Generate's turn on the compute thread: one scheduler iteration per turn.

The scheduler (engine/scheduler.py) decides, the runner (engine/runner.py) runs the model
and the sampler, the output stage (engine/output.py) turns the sampled ids into chunks on
the model's text thread; the pacer (engine/pacing.py) narrows the prefill chunk while rows
decode, from the iteration times it is shown here. Warmup steps (calls) run only when no
request holds a row: while one waits, no new request is admitted (a warmup step may resize
the KV cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from inference_svc.engine.compute import Call
from inference_svc.engine.inbox import Inbox, Stop
from inference_svc.engine.output import OutputStage
from inference_svc.engine.pacing import ChunkPacer
from inference_svc.engine.runner import GenerateRunner
from inference_svc.engine.scheduler import Scheduler, Sequence
from inference_svc.errors import Unavailable

log = logging.getLogger(__name__)


class GenerateLoop:
    def __init__(
        self,
        inbox: Inbox[Sequence],
        scheduler: Scheduler,
        runner: GenerateRunner,
        output: OutputStage,
        pacer: ChunkPacer | None = None,
    ) -> None:
        self.name, self.inbox = inbox.name, inbox
        self.scheduler, self.runner, self.output = scheduler, runner, output
        self.pacer = pacer
        self._calls: deque[Call] = deque()
        inbox.waiting = lambda: len(scheduler.waiting)
        inbox.compute.register(self)

    def holding_for(self) -> float | None:
        return None

    def poll(self) -> bool:
        if not self._drain():
            self._shut_down()
            return True
        sched = self.scheduler
        sched.reap()
        if self._calls and not sched.running:
            self._calls.popleft().run()
            return True
        if not self._calls:
            sched.set_rows(self.runner.rows())
            sched.admit()
        self.inbox.rows_in_use = len(sched.running)
        if not sched.running:
            return False
        try:
            self._iterate()
        except Exception as exc:  # a real fault: every admitted request gets it
            log.exception("model %s: step over %d requests failed", self.name, len(sched.running))
            self.output.fail(sched.abort(), exc)
        return True

    def _drain(self) -> bool:
        """Move what arrived to the scheduler and the call queue; False on a stop."""
        while (item := self.inbox.get()) is not None:
            if isinstance(item, Stop):
                return False
            if isinstance(item, Call):
                self._calls.append(item)
            else:
                self.scheduler.add(item)
        return True

    def _iterate(self) -> None:
        sched, runner, pacer = self.scheduler, self.runner, self.pacer
        start = time.perf_counter()
        chunk = sched.next_chunk(pacer.limit(sched.decoding, sched.prompts) if pacer else None)
        width = 0
        if chunk is not None:
            runner.prefill(chunk)
            sched.prefilled(chunk)
            width = runner.chunk_width(len(chunk.ids))
            self.inbox.chunks_by_tokens[width] += 1
        decoded = 0
        if ready := sched.ready():
            drawn = runner.sample(ready)
            plan = sched.sampled([(seq, token) for seq, token, _ in drawn])
            self.output.push([runner.read_back(seq, token, out) for seq, token, out in drawn])
            if plan is not None:
                runner.decode(plan)
                sched.decoded(plan)
                self.inbox.batches_by_rows[len(plan.tokens)] += 1
                decoded = len(plan.tokens)
        if pacer:
            pacer.observe(width, decoded, time.perf_counter() - start)

    def _shut_down(self) -> None:
        stopped = Unavailable(f"model {self.name}: the service is stopping")
        self.output.fail(self.scheduler.abort(waiting_too=True), stopped)
        for call in self._calls:
            call.future.cancel()
        self.inbox.compute.unregister(self)
        self.inbox.stopped.set()
