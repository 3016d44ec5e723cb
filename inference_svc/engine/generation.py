"""Generate requests under continuous batching: iteration-level scheduling over the rows
of the static KV cache.

Each request holds one cache row from its admission to its last token; its slots are its
positions (slot i holds the token at position i), so rows of different lengths and ages
decode together: a decode step writes each row at its own slot and masks each row to its
own slots. One scheduler iteration, one turn on the compute thread (engine/worker.py):

1. reap: a cancelled request (a client gone, a deadline passed) frees its row now;
2. admit: waiting requests take the lowest free rows, oldest first (FIFO, no starvation);
3. prefill ONE chunk (at most ``--prefill-chunk-tokens`` tokens) of the oldest request
   still prefilling. Policy: running streams are never paused for a whole long prompt, so
   the gap between two of their tokens is at most one decode step plus one chunk; a
   joining request's first token waits for at most one decode step per chunk;
4. sample every row whose next-token logits are ready (rows just decoded and a request
   whose prefill just ended): one sampler call, each row with its own parameters and,
   when seeded, its own generator; emit each row's token;
5. decode one step for every row that goes on.

Shapes stay inside what Describe lists: a decode step runs over rows [0, B) with B a
batch bucket covering the highest busy row (free rows inside are padding, each writing a
slot nobody attends to) and a context bucket covering the highest slot; a chunk is padded
to a chunk bucket. Rows are taken lowest first, so B follows the load.

Warmup steps (calls) run only when no request holds a row: while one waits, no new
request is admitted (a warmup step may reallocate the cache).
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference_api.plan import LogprobsMode
from inference_svc.compile_monitor import Origin
from inference_svc.engine.rowstate import RowState
from inference_svc.engine.types import GenChunk, GenerateParams, TokenLogprob
from inference_svc.engine.worker import ModelWorker, _Call
from inference_svc.errors import InvalidArgument, Unavailable
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import Sampler, SamplerOutput, SamplingMetadata

log = logging.getLogger(__name__)


@dataclass
class GenJob:
    prompt_ids: list[int]
    params: GenerateParams
    emit: Callable[[GenChunk | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


def request_generator(params: GenerateParams, device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator (it lives as long as the request)."""
    if params.seed is None or params.temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sampling_metadata(
    params: list[GenerateParams | None],
    generators: dict[int, torch.Generator],
    device: torch.device,
    mode: LogprobsMode,
) -> SamplingMetadata:
    """Metadata for a padded batch; ``None`` rows are padding (greedy, nothing drawn)."""
    real = [p for p in params if p is not None]
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature if p else 0.0 for p in params], device=device),
        top_k=torch.tensor([p.top_k if p else 0 for p in params], device=device),
        top_p=torch.tensor([p.top_p if p else 1.0 for p in params], device=device),
        generators=generators,
        num_logprobs=max((p.logprobs for p in real), default=0),
        logprobs_mode=mode,
    )


@dataclass(eq=False)
class Seq:
    """A request in its cache row."""

    job: GenJob
    row: int
    state: RowState
    generator: torch.Generator | None
    filled: int = 0  # slots written: prompt tokens, then decoded tokens
    ready: bool = False  # the logits buffer's row holds this request's next distribution

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.job.prompt_ids)

    @property
    def gone(self) -> bool:
        return self.state.done or self.job.cancelled.is_set()


class GenerateWorker(ModelWorker[GenJob]):
    def __init__(
        self, model: GenerativeModel, sampler: Sampler, mode: LogprobsMode, max_queue: int
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.logprobs_mode = mode
        self.seqs: list[Seq] = []  # admitted, in admission order
        self._free: list[int] = []  # free rows (a heap: lowest first)
        self._logits: Tensor | None = None  # [rows, vocab]: each row's next distribution
        self._calls: deque[_Call] = deque()  # warmup steps: they run when no row is busy
        super().__init__(model.name, max_queue)

    def prepare(self, params: GenerateParams) -> list[int]:
        """Tokenize the prompt and check its length; raises InvalidArgument."""
        m = self.model
        messages = [{"role": r, "content": c} for r, c in params.messages]
        ids = m.encode(params.prompt, messages)
        if not ids:
            raise InvalidArgument("prompt: no tokens after tokenization")
        if len(ids) > m.limits.max_input_tokens:
            raise InvalidArgument(
                f"prompt: {len(ids)} tokens; the limit is {m.limits.max_input_tokens} "
                "(--max-input-tokens)"
            )
        return ids

    def fail(self, job: GenJob, exc: BaseException) -> None:
        job.emit(exc)

    # -- the scheduler: one iteration per turn on the compute thread ----------------
    def poll(self) -> bool:
        if not self._drain():
            self._shut_down()
            return True
        self._reap()
        if self._calls and not self.seqs:
            self._calls.popleft().run()
            return True
        if not self._calls:
            self._admit()
        if self.seqs:
            self._iterate()
            return True
        return False

    def _drain(self) -> bool:
        """Move what arrived into the waiting list and the call queue; False on stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            if isinstance(item, _Call):
                self._calls.append(item)
            else:
                self._pending.append(item)

    def _reap(self) -> None:
        for seq in [s for s in self.seqs if s.gone]:
            self._release(seq)
        self._pending[:] = [j for j in self._pending if not j.cancelled.is_set()]

    def _release(self, seq: Seq) -> None:
        self.seqs.remove(seq)
        heapq.heappush(self._free, seq.row)
        self.rows_in_use = len(self.seqs)

    def _admit(self) -> None:
        m = self.model
        if self._logits is None or len(self._logits) != m.cache_rows:  # (re)sized by PROFILE
            self._free = list(range(m.cache_rows))
            self._logits = torch.zeros(m.cache_rows, m.lm.shape.vocab_size, device=m.device)
        while self._pending and self._free:
            job = self._pending.pop(0)
            row = heapq.heappop(self._free)
            state = RowState(job.params, len(job.prompt_ids), m.eos_ids, m.detokenize)
            self.seqs.append(Seq(job, row, state, request_generator(job.params, m.device)))
        self.rows_in_use = len(self.seqs)

    def _iterate(self) -> None:
        try:
            self._prefill_chunk()
            self._decode(self._sample())
        except Exception as exc:  # a real fault: every admitted request gets it
            log.exception("model %s: step over %d requests failed", self.name, len(self.seqs))
            for seq in list(self.seqs):
                self.fail(seq.job, exc)
                self._release(seq)

    def _prefill_chunk(self) -> None:
        seq = next((s for s in self.seqs if s.prefilling), None)
        if seq is None:
            return
        prompt = seq.job.prompt_ids
        ids = prompt[seq.filled : seq.filled + self.model.limits.prefill_chunk]
        logits = self.model.prefill(seq.row, ids, seq.filled, Origin.REQUEST)
        seq.filled += len(ids)
        if seq.filled == len(prompt):
            assert self._logits is not None
            self._logits[seq.row] = logits[0]
            seq.ready = True

    def _sample(self) -> list[tuple[Seq, int]]:
        """Sample and emit a token for every ready row; returns the rows that go on."""
        ready = [s for s in self.seqs if s.ready and not s.gone]
        if not ready:
            return []
        assert self._logits is not None
        batch = self.model.batch_bucket(max(s.row for s in ready) + 1)
        params: list[GenerateParams | None] = [None] * batch
        gens: dict[int, torch.Generator] = {}
        for s in ready:
            params[s.row] = s.job.params
            if s.generator is not None:
                gens[s.row] = s.generator
        md = sampling_metadata(params, gens, self.model.device, self.logprobs_mode)
        out = self.sampler(self._logits[:batch], md)
        tokens = out.tokens.tolist()
        going = []
        for s in ready:
            s.ready = False
            token = tokens[s.row]
            lp = self._logprob(out, s.row, token, s.job.params.logprobs)
            s.job.emit(s.state.push(token, lp))
            if s.state.done:
                self._release(s)
            else:
                going.append((s, token))
        return going

    def _decode(self, going: list[tuple[Seq, int]]) -> None:
        """One step for the rows that go on; every other row below the batch bucket is
        padding that writes its own next free slot (a prefilling row's next chunk, or a
        free row's slot 0), which nobody attends to before it is written again."""
        if not going:
            return
        m = self.model
        batch = m.batch_bucket(max(s.row for s, _ in going) + 1)
        tokens = [m.pad_id] * batch
        positions = [0] * batch
        for s in self.seqs:
            if s.row < batch:
                positions[s.row] = s.filled
        for s, token in going:
            tokens[s.row] = token
        logits = m.decode(torch.tensor(tokens), positions, Origin.REQUEST)
        assert self._logits is not None
        self._logits[:batch] = logits
        for s, _ in going:
            s.filled += 1
            s.ready = True
        self.batches_by_rows[len(going)] += 1

    def _logprob(self, out: SamplerOutput, row: int, token: int, n: int) -> TokenLogprob | None:
        if n <= 0 or out.logprobs is None:
            return None
        assert out.top_ids is not None and out.top_logprobs is not None
        text = self.model.token_text
        top = zip(out.top_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist(), strict=True)
        return TokenLogprob(
            token, text(token), float(out.logprobs[row]), tuple((i, text(i), v) for i, v in top)
        )

    def _shut_down(self) -> None:
        stopped = Unavailable(f"model {self.name}: the service is stopping")
        for seq in list(self.seqs):
            self.fail(seq.job, stopped)
            self._release(seq)
        for job in self._pending:
            self.fail(job, stopped)
        self._pending.clear()
        self._retire()


def random_logits(batch: int, vocab: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Logits for sampler warmup: random, not zeros (zeros would tie every token)."""
    return (torch.randn(batch, vocab, generator=gen) * 3).to(device)
