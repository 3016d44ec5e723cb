"""Generate's turn on a real compute thread, with the real scheduler, inbox and output stage
and a scripted runner (no model): chunks in order, rows freed and reused, stop strings ending
a request from the output stage, a failing step answering every running request, a stop
answering the waiting ones, a joiner's prompt cut narrower while others decode; the output
stage never runs on the compute thread."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference_svc.engine.buckets import bucket_for
from inference_svc.engine.compute import ComputeThread
from inference_svc.engine.generate_loop import GenerateLoop
from inference_svc.engine.inbox import Inbox
from inference_svc.engine.output import OutputStage, Sampled
from inference_svc.engine.pacing import ChunkPacer
from inference_svc.engine.scheduler import DecodePlan, Scheduler, Sequence
from inference_svc.engine.types import FinishReason, GenChunk, GenerateParams
from inference_svc.errors import Unavailable

pytestmark = pytest.mark.unit
EOS = 0
STEP_S = 0.005
WIDTHS = (16, 32, 48, 64)  # the chunk buckets of a 64-token chunk limit


def letters(ids: list[int]) -> str:
    return "".join(chr(96 + i) for i in ids)  # 1 -> "a", 2 -> "b", ...


class ScriptedRunner:
    """Each request samples the tokens of its script (keyed by its seed), in order."""

    def __init__(
        self, rows: int, scripts: dict[int, list[int]], fail: bool = False, token_s: float = 0
    ) -> None:
        self._rows, self.scripts, self.fail = rows, scripts, fail
        self.token_s = token_s  # a prefill's time per prompt token
        self.decoded: list[dict[int, int]] = []
        self.chunks: dict[int, list[int]] = {}  # seed -> its chunks' token counts

    def rows(self) -> int:
        return self._rows

    @staticmethod
    def chunk_width(tokens: int) -> int:
        return bucket_for(tokens, WIDTHS)

    def prefill(self, chunk) -> None:
        self.chunks.setdefault(chunk.seq.params.seed, []).append(len(chunk.ids))
        time.sleep(self.token_s * len(chunk.ids))

    def sample(self, seqs: list[Sequence]):
        return [(s, self.scripts[s.params.seed][s.generated], None) for s in seqs]

    @staticmethod
    def read_back(seq: Sequence, token: int, out: object) -> Sampled:
        return Sampled(seq, token, seq.finish)

    def decode(self, plan: DecodePlan) -> None:
        if self.fail:
            raise RuntimeError("injected: the step failed")
        self.decoded.append(dict(plan.tokens))
        time.sleep(STEP_S)  # a model's step takes time; the output stage keeps up


class Client:
    def __init__(
        self, seed: int, stop: tuple[str, ...] = (), max_tokens: int = 16, prompt: int = 3
    ) -> None:
        self.events: queue.Queue[GenChunk | BaseException] = queue.Queue()
        self.threads: set[str] = set()
        params = GenerateParams("p", (), temperature=0.5, seed=seed, max_tokens=max_tokens,
                                stop=stop)  # fmt: skip
        self.seq = Sequence([5, 6, 7] * (prompt // 3) + [5] * (prompt % 3), params, self._emit)

    def _emit(self, event: GenChunk | BaseException) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.put(event)

    def result(self) -> tuple[str, FinishReason | BaseException]:
        text = ""
        while True:
            event = self.events.get(timeout=10)
            if isinstance(event, BaseException):
                return text, event
            text += event.text
            if event.finish is not None:
                return text, event.finish


@pytest.fixture
def make_loop():
    made = []

    def make(runner: ScriptedRunner) -> Inbox[Sequence]:
        inbox: Inbox[Sequence] = Inbox("lm", 16, ComputeThread())
        text = ThreadPoolExecutor(1, thread_name_prefix="text")
        GenerateLoop(inbox, Scheduler(64, frozenset({EOS})), runner,  # type: ignore[arg-type]
                     OutputStage(text, letters, lambda i: letters([i])),
                     ChunkPacer(WIDTHS))  # fmt: skip
        made.append(inbox)
        return inbox

    yield make
    for inbox in made:
        inbox.stop()


def test_requests_stream_in_order_and_free_their_rows(make_loop) -> None:
    runner = ScriptedRunner(2, {1: [1, 2, EOS], 2: [3, 4, 5, 6], 3: [7, 8, EOS]})
    inbox = make_loop(runner)
    a, b, c = Client(1), Client(2, max_tokens=4), Client(3)
    for client in (a, b, c):  # two rows: c waits for a's row
        inbox.submit(client.seq)
    assert a.result() == ("ab", FinishReason.EOS)
    assert b.result() == ("cdef", FinishReason.LENGTH)
    assert c.result() == ("gh", FinishReason.EOS)
    assert c.seq.row == a.seq.row == 0 and b.seq.row == 1
    assert all(not name.startswith("compute") for x in (a, b, c) for name in x.threads)


def test_a_stop_string_ends_the_request_and_frees_its_row(make_loop) -> None:
    # "cd" stops request 1 at its 4th token; it could have run 40. The stop is found on the
    # text thread, so a token or two more may be sampled before the scheduler sees it.
    runner = ScriptedRunner(1, {1: [1, 2, 3, 4] + [5] * 36, 2: [1, EOS]})
    inbox = make_loop(runner)
    a, b = Client(1, stop=("cd",), max_tokens=40), Client(2)
    inbox.submit(a.seq)
    inbox.submit(b.seq)
    assert a.result() == ("ab", FinishReason.STOP)
    assert b.result() == ("a", FinishReason.EOS)  # it got the only row after a's stop
    assert a.seq.generated < 40


def test_a_failing_step_answers_every_running_request(make_loop) -> None:
    inbox = make_loop(ScriptedRunner(2, {1: [1, 2], 2: [3, 4]}, fail=True))
    a, b = Client(1), Client(2)
    inbox.submit(a.seq)
    inbox.submit(b.seq)
    for client in (a, b):
        _, error = client.result()
        assert isinstance(error, RuntimeError) and "injected" in str(error)
    assert inbox.depth() == 0


def test_a_stop_answers_what_waits_unavailable(make_loop) -> None:
    runner = ScriptedRunner(1, {1: [1] * 16, 2: [2, EOS]})
    inbox = make_loop(runner)
    release = threading.Event()
    blocked = inbox.compute.run(release.wait)  # the compute thread is busy: all wait
    a, b = Client(1), Client(2)
    inbox.submit(a.seq)
    inbox.submit(b.seq)
    inbox.stop(timeout=0)
    release.set()
    blocked.result(10)
    for client in (a, b):
        _, error = client.result()
        assert isinstance(error, Unavailable)


def test_a_joiner_prefills_in_narrow_chunks_while_others_decode(make_loop) -> None:
    # A prompt token costs 0.8 ms to prefill: a 64-token chunk ~51 ms, ten decode steps.
    scripts = {1: [1, EOS], 2: [2] * 80, 3: [2] * 80, 4: [3, EOS]}
    runner = ScriptedRunner(3, scripts, token_s=0.0008)
    inbox = make_loop(runner)
    alone = Client(1, prompt=64)
    inbox.submit(alone.seq)
    assert alone.result() == ("a", FinishReason.EOS)
    running = [Client(2, max_tokens=80), Client(3, max_tokens=80)]
    for client in running:
        inbox.submit(client.seq)
    deadline = time.monotonic() + 10
    while min(c.seq.generated for c in running) < 3 and time.monotonic() < deadline:
        time.sleep(STEP_S)
    joiner = Client(4, prompt=64)
    inbox.submit(joiner.seq)
    assert joiner.result() == ("c", FinishReason.EOS)
    assert all(c.seq.generated < 80 for c in running)  # still decoding when it finished
    assert runner.chunks[1] == [64]  # on an idle service: the widest chunk
    assert runner.chunks[4] == [16, 16, 16, 16]  # each no costlier than ~two decode steps
    assert [c.result() for c in running] == [("b" * 80, FinishReason.LENGTH)] * 2
