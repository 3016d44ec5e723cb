"""The Generate scheduler: which requests hold a KV-cache row, which prompt chunk prefills
next, which rows sample and decode. Pure bookkeeping: no torch, no gRPC, unit-tested alone.

Each request holds one cache row from its admission to its last token; its slots are its
positions (slot i holds the token at position i), so rows of different lengths and ages
decode together. One iteration (engine/generate_loop.py drives it):

1. ``reap()`` (a cancelled request, or one the output stage ended on a stop string, frees
   its row now); ``admit()`` (waiting requests take the lowest free rows, oldest first:
   FIFO, no starvation); ``next_chunk(limit)``: ONE prefill chunk (at most ``chunk_tokens``
   tokens, fewer while rows are decoding: engine/pacing.py sets ``limit``) of the oldest
   request still prefilling. Running streams are never paused for a whole long prompt: the
   gap between two of their tokens is at most one decode step plus one chunk, and a joining
   request's first token waits at most one decode step per chunk;
2. ``prefilled(chunk)`` once the runner wrote it;
3. ``ready()``: every row whose next-token logits are ready (rows just decoded, and a
   request whose prefill just ended) samples, in one sampler call;
4. ``sampled(tokens)``: a row that drew an end-of-sequence token or reached its
   ``max_tokens`` finishes and frees its row; the rest go on: the decode plan;
5. ``decoded(plan)`` once the runner ran it.

Rows are taken lowest first, so the decode batch (rows [0, highest busy row]) follows the load.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference_svc.engine.types import FinishReason, GenChunk, GenerateParams


@dataclass(eq=False)
class Sequence:
    """One Generate request from submission to its last chunk."""

    prompt_ids: list[int]
    params: GenerateParams
    emit: Callable[[GenChunk | BaseException], None]  # thread-safe: hands a chunk to the caller
    cancelled: threading.Event = field(default_factory=threading.Event)  # the caller is gone
    row: int = -1  # its KV-cache row while admitted
    filled: int = 0  # slots written: prompt tokens, then decoded tokens
    ready: bool = False  # the runner's logits row holds this request's next distribution
    generated: int = 0  # tokens sampled
    finish: FinishReason | None = None  # set here: end-of-sequence or length
    stopped: bool = False  # set by the output stage: a stop string, or the caller was answered
    generator: Any = None  # the runner's random generator for a seeded request
    text: Any = None  # the output stage's state (engine/output.py)

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt_ids)

    @property
    def gone(self) -> bool:
        return self.finish is not None or self.stopped or self.cancelled.is_set()


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens ``ids`` of ``seq`` to write from slot ``start``; ``last``: its prefill ends."""

    seq: Sequence
    start: int
    ids: list[int]

    @property
    def last(self) -> bool:
        return self.start + len(self.ids) == len(self.seq.prompt_ids)


@dataclass(frozen=True)
class DecodePlan:
    """One decode step: each going row's token, and every admitted row's next slot (rows
    that do not go on are padding inside the batch and write a slot nobody attends to)."""

    tokens: dict[int, int]  # row -> the token it decodes
    positions: dict[int, int]  # row -> the slot it writes (every admitted row)

    @property
    def top_row(self) -> int:
        return max(self.tokens)


class Scheduler:
    def __init__(self, chunk_tokens: int, eos_ids: frozenset[int]) -> None:
        self.chunk_tokens = chunk_tokens
        self.eos_ids = eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        self.rows = 0  # KV-cache rows to hand out (0 until the cache is sized)
        self._free: list[int] = []  # a heap: lowest row first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def set_rows(self, rows: int) -> None:
        """The cache has ``rows`` rows (sized or resized while nothing runs)."""
        if rows != self.rows:
            assert not self.running, "the KV cache was resized under running requests"
            self.rows, self._free = rows, list(range(rows))

    # -- one iteration ------------------------------------------------------------------
    def reap(self) -> list[Sequence]:
        """Free the rows of requests that are gone; drop cancelled waiting ones."""
        gone = [s for s in self.running if s.gone]
        for seq in gone:
            self._release(seq)
        self.waiting = deque(s for s in self.waiting if not s.cancelled.is_set())
        return gone

    def admit(self) -> None:
        while self.waiting and self._free:
            seq = self.waiting.popleft()
            seq.row = heapq.heappop(self._free)
            self.running.append(seq)

    @property
    def decoding(self) -> int:
        """Admitted requests past their prompt: they sample and decode this iteration."""
        return sum(not s.prefilling and not s.gone for s in self.running)

    @property
    def prompts(self) -> int:
        """Requests waiting for their first token: admitted and prefilling, or queued."""
        return sum(s.prefilling and not s.gone for s in self.running) + len(self.waiting)

    def next_chunk(self, limit: int | None = None) -> Chunk | None:
        """The next chunk: at most ``limit`` (default and cap: ``chunk_tokens``) tokens."""
        seq = next((s for s in self.running if s.prefilling and not s.gone), None)
        if seq is None:
            return None
        n = min(limit or self.chunk_tokens, self.chunk_tokens)
        return Chunk(seq, seq.filled, seq.prompt_ids[seq.filled : seq.filled + n])

    def prefilled(self, chunk: Chunk) -> None:
        chunk.seq.filled += len(chunk.ids)
        chunk.seq.ready = chunk.last

    def ready(self) -> list[Sequence]:
        return [s for s in self.running if s.ready and not s.gone]

    def sampled(self, tokens: list[tuple[Sequence, int]]) -> DecodePlan | None:
        """Record each row's sampled token; the rows that go on decode next (None: none)."""
        going: dict[int, int] = {}
        for seq, token in tokens:
            seq.ready = False
            seq.generated += 1
            if token in self.eos_ids:
                seq.finish = FinishReason.EOS
            elif seq.generated >= seq.params.max_tokens:
                seq.finish = FinishReason.LENGTH
            if seq.finish is not None:
                self._release(seq)
            else:
                going[seq.row] = token
        if not going:
            return None
        return DecodePlan(going, {s.row: s.filled for s in self.running})

    def decoded(self, plan: DecodePlan) -> None:
        for seq in self.running:
            if seq.row in plan.tokens:
                seq.filled += 1
                seq.ready = True

    # -- endings ------------------------------------------------------------------------
    def abort(self, waiting_too: bool = False) -> list[Sequence]:
        """Every running request (and waiting one, with ``waiting_too``) taken out, rows
        freed: the caller answers them."""
        out = list(self.running)
        for seq in out:
            self._release(seq)
        if waiting_too:
            out += self.waiting
            self.waiting.clear()
        return out

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        heapq.heappush(self._free, seq.row)
