"""--embed-batch-wait-ms: after a batch of several calls, the next batch waits (briefly) for
the callers just answered, so concurrent closed-loop callers share one batch instead of
settling into two half-size cohorts; a lone call never waits, and neither does a call or a
stop queued behind held jobs. On a real compute thread, with a batcher whose batches
take a known time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from inference_svc.config import parse_config
from inference_svc.engine.batcher import Batcher
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.inbox import Inbox

pytestmark = pytest.mark.unit

RUN_S = 0.2  # how long every batch takes


class Job:
    def __init__(self) -> None:
        self.future: Future[float] = Future()  # resolves to when its batch started
        self.submitted = time.monotonic()


class Recorder:
    """An inbox and a batcher on a compute thread of their own; batches of at most 8 jobs."""

    def __init__(self, batch_wait_s: float) -> None:
        self.inbox: Inbox[Job] = Inbox("recorder", 64, ComputeThread())
        self.batcher = Batcher(
            self.inbox, self.run_batch, self.fail, capacity=8,
            batch_wait_s=batch_wait_s,
        )  # fmt: skip
        self.batches: list[int] = []

    def submit(self, job: Job) -> None:
        self.inbox.submit(job)

    def call(self, fn):
        return self.inbox.call(fn)

    def run_batch(self, jobs: list[Job]) -> None:
        started = time.monotonic()
        self.batches.append(len(jobs))
        time.sleep(RUN_S)
        for job in jobs:
            job.future.set_result(started)

    def fail(self, job: Job, exc: BaseException) -> None:
        job.future.set_exception(exc)


@pytest.fixture
def worker(request):
    w = Recorder(getattr(request, "param", 1.0))
    yield w
    w.inbox.stop()


def submit(w: Recorder, n: int) -> list[Job]:
    jobs = [Job() for _ in range(n)]
    for job in jobs:
        w.submit(job)
    return jobs


def first_batch_of(w: Recorder, n: int) -> None:
    """A batch of ``n`` calls, all queued before it starts (the compute thread is held)."""
    release = threading.Event()
    blocked = w.call(release.wait)
    jobs = submit(w, n)
    release.set()
    blocked.result(10)
    for job in jobs:
        job.future.result(10)
    assert w.batches[-1] == n


def test_callers_coming_back_after_a_batch_share_the_next_one(worker) -> None:
    first_batch_of(worker, 4)
    early = submit(worker, 1)  # the first caller back would start a batch of one
    time.sleep(0.02)
    late = submit(worker, 3)
    for job in early + late:
        job.future.result(10)
    assert worker.batches == [4, 4]


def test_the_wait_ends_after_at_most_one_batch_time(worker) -> None:
    first_batch_of(worker, 4)
    (job,) = submit(worker, 1)  # the other three callers never come back
    started = job.future.result(10)
    assert worker.batches == [4, 1]
    assert RUN_S / 2 <= started - job.submitted < 5 * RUN_S


def test_a_lone_call_never_waits(worker) -> None:
    first_batch_of(worker, 1)
    (job,) = submit(worker, 1)
    assert job.future.result(10) - job.submitted < RUN_S / 2
    first_batch_of(worker, 4)
    time.sleep(1.5 * RUN_S)  # idle for longer than a batch: the hold is over
    (job,) = submit(worker, 1)
    assert job.future.result(10) - job.submitted < RUN_S / 2
    assert worker.batches == [1, 1, 4, 1]


@pytest.mark.parametrize("worker", [0.0], indirect=True)
def test_zero_turns_the_wait_off(worker) -> None:
    first_batch_of(worker, 4)
    (job,) = submit(worker, 1)
    assert job.future.result(10) - job.submitted < RUN_S / 2


def test_a_call_queued_behind_held_jobs_is_not_held(worker) -> None:
    first_batch_of(worker, 4)
    (job,) = submit(worker, 1)
    t0 = time.monotonic()
    worker.call(lambda: None).result(10)
    assert job.future.done() and time.monotonic() - t0 < 1.5 * RUN_S


def test_the_flag_defaults_to_20_ms_and_refuses_negative_values(capsys) -> None:
    assert parse_config([]).embed_batch_wait_ms == 20.0
    assert parse_config(["--embed-batch-wait-ms", "0"]).embed_batch_wait_ms == 0.0
    with pytest.raises(SystemExit):
        parse_config(["--embed-batch-wait-ms", "-1"])
    assert "--embed-batch-wait-ms" in capsys.readouterr().err


def test_a_stop_answers_the_jobs_still_waiting(worker) -> None:
    release = threading.Event()
    blocked = worker.call(release.wait)
    jobs = submit(worker, 4)  # before the stop: they run
    worker.inbox.stop(timeout=0)  # queued behind them; returns at once
    jobs += submit(worker, 2)  # behind the stop: answered UNAVAILABLE, not left hanging
    release.set()
    blocked.result(10)
    outcomes = []
    for job in jobs:
        try:
            job.future.result(10)
            outcomes.append("ran")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["ran"] * 4 + ["Unavailable"] * 2
    assert worker.inbox.stopped.wait(10)
