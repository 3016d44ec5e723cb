"""The Generate runner: runs what the scheduler planned on the model and the sampler.

It owns the logits buffer (one row per KV-cache row: each row's next distribution), pads
each step to a declared shape (the model's one ``GenBuckets`` value) and reads back only
the sampled ids (and, when asked, their logprobs) as plain numbers for the output stage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference_api.plan import Bucket, LogprobsMode, Phase
from inference_svc.compile_monitor import Origin
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.output import Sampled
from inference_svc.engine.scheduler import Chunk, DecodePlan, Sequence
from inference_svc.engine.types import GenerateParams
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import Sampler, SamplerOutput, SamplingMetadata


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
        filters=any(p.top_k > 0 or p.top_p < 1.0 for p in real),
    )


def _plain_greedy(params: GenerateParams) -> bool:
    return params.temperature <= 0 and params.logprobs <= 0


_NOTHING_MORE = SamplerOutput(torch.empty(0, dtype=torch.long))  # the tokens are read back


def random_logits(batch: int, vocab: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Logits for sampler warmup: random, not zeros (zeros would tie every token)."""
    return (torch.randn(batch, vocab, generator=gen) * 3).to(device)


class GenerateRunner:
    """Pads the scheduler's plan to the model's buckets and runs it; also runs a dummy step
    at any declared shape (PROFILE, COMPILE)."""

    def __init__(
        self, model: GenerativeModel, sampler: Sampler, mode: LogprobsMode, buckets: GenBuckets
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.logprobs_mode = mode
        self._buckets = buckets
        self._logits: Tensor | None = None  # [rows, vocab]
        # Where the sampler's greedy path is eager (mode none; the eager sampler beside
        # AOTInductor packages), a batch of greedy rows asking for no logprobs takes the
        # argmax at once: no metadata tensors, no sampler call. It is the same op, so the
        # same tokens; each tensor op between two decode steps runs on caches the step's
        # weights just flushed (~70 us each on an AVX-512 EPYC, 5 when warm).
        self._plain_argmax = not sampler.compiled_greedy
        self.request_shapes: set[Bucket] = set()  # what requests ran (tests check vs Describe)

    @property
    def buckets(self) -> GenBuckets:
        """The shapes, with the KV cache's rows as they are now (a new value only when
        PROFILE or --kv-cache-tokens resized the cache, not at every step)."""
        if self._buckets.rows != self.model.cache_rows:
            self._buckets = self._buckets.with_rows(self.model.cache_rows)
        return self._buckets

    def rows(self) -> int:
        """KV-cache rows (0 before PROFILE or --kv-cache-tokens sized the cache)."""
        m = self.model
        if self._logits is None or len(self._logits) != m.cache_rows:
            self._logits = torch.zeros(m.cache_rows, m.lm.shape.vocab_size, device=m.device)
        return m.cache_rows

    # -- a request's steps --------------------------------------------------------------
    def prefill(self, chunk: Chunk) -> None:
        seq = chunk.seq
        logits = self.pad_prefill(seq.row, chunk.ids, chunk.start, Origin.REQUEST)
        if chunk.last:
            assert self._logits is not None
            self._logits[seq.row] = logits[0]

    def sample(self, seqs: list[Sequence]) -> list[tuple[Sequence, int, SamplerOutput]]:
        """One sampler call over the rows of ``seqs``, each with its own parameters and,
        when seeded, its own generator (made at its first token)."""
        m = self.model
        assert self._logits is not None
        batch = self.buckets.sampler_batch(max(s.row for s in seqs) + 1)
        if self._plain_argmax and all(_plain_greedy(s.params) for s in seqs):
            tokens = self._logits[:batch].argmax(dim=-1).tolist()
            return [(s, tokens[s.row], _NOTHING_MORE) for s in seqs]
        params: list[GenerateParams | None] = [None] * batch
        gens: dict[int, torch.Generator] = {}
        for s in seqs:
            params[s.row] = s.params
            if s.generated == 0 and s.generator is None:
                s.generator = request_generator(s.params, m.device)
            if s.generator is not None:
                gens[s.row] = s.generator
        md = sampling_metadata(params, gens, m.device, self.logprobs_mode)
        out = self.sampler(self._logits[:batch], md)
        tokens = out.tokens.tolist()
        return [(s, tokens[s.row], out) for s in seqs]

    @staticmethod
    def read_back(seq: Sequence, token: int, out: SamplerOutput) -> Sampled:
        """The numbers the output stage needs for one row (logprobs only when asked)."""
        n = seq.params.logprobs
        if n <= 0 or out.logprobs is None:
            return Sampled(seq, token, seq.finish)
        assert out.top_ids is not None and out.top_logprobs is not None
        ids, lps = out.top_ids[seq.row, :n].tolist(), out.top_logprobs[seq.row, :n].tolist()
        lp = float(out.logprobs[seq.row])
        return Sampled(seq, token, seq.finish, lp, tuple(zip(ids, lps, strict=True)))

    def decode(self, plan: DecodePlan) -> None:
        """One step for the rows that go on; every other row below the batch bucket is
        padding that writes its own next free slot (a prefilling row's next chunk, or a
        free row's slot 0), which nobody attends to before it is written again."""
        batch = self.buckets.batch_for(plan.top_row + 1)
        tokens = [self.model.pad_id] * batch
        positions = [0] * batch
        for row, slot in plan.positions.items():
            if row < batch:
                positions[row] = slot
        for row, token in plan.tokens.items():
            tokens[row] = token
        logits = self.pad_decode(tokens, positions, Origin.REQUEST)
        assert self._logits is not None
        self._logits[:batch] = logits

    # -- padding ------------------------------------------------------------------------
    def chunk_width(self, tokens: int) -> int:
        """The width a chunk of ``tokens`` prompt tokens is padded to."""
        return self.buckets.chunk_width(tokens)

    def pad_prefill(self, row: int, ids: list[int], start: int, origin: Origin) -> Tensor:
        """One chunk of a prompt into cache ``row`` from slot ``start``, right-padded to a
        chunk bucket: the padding writes the next free slots, which the next chunk or
        decode overwrites before anyone attends to them."""
        shape = self.buckets.chunk_shape(start, len(ids))
        width, slots = shape.seq_len, self.model.limits.max_seq_len
        tokens = torch.full((1, width), self.model.pad_id, dtype=torch.long)
        tokens[0, : len(ids)] = torch.tensor(ids)
        positions = (torch.arange(width) + start).clamp(max=slots - 1)[None]
        last = torch.tensor([len(ids) - 1])
        self._seen(shape, origin)
        return self.model.prefill(row, tokens, positions, last, shape, origin)

    def pad_decode(self, tokens: list[int], positions: list[int], origin: Origin) -> Tensor:
        """A step over cache rows [0, len(tokens)), padded to a batch bucket with rows that
        write slot 0 of rows nobody reads."""
        shape = self.buckets.decode_shape(len(positions), max(positions))
        pad = shape.batch_size - len(positions)
        ids = torch.tensor(tokens + [self.model.pad_id] * pad)[:, None]
        pos = torch.tensor(positions + [0] * pad)[:, None]
        self._seen(shape, origin)
        return self.model.decode(ids, pos, shape, origin)

    def _seen(self, shape: Bucket, origin: Origin) -> None:
        if origin is Origin.REQUEST:
            self.request_shapes.add(shape)

    # -- dummy steps (warmup) -----------------------------------------------------------
    def run_shape(self, bucket: Bucket, gen: torch.Generator) -> Tensor:
        """A step of random tokens at ``bucket``: a chunk into row 0 ending at its context,
        or a decode over rows at random slots, the highest at the last one."""
        vocab = self.model.lm.shape.vocab_size
        if bucket.phase is Phase.PREFILL:
            ids = torch.randint(0, vocab, (bucket.seq_len,), generator=gen).tolist()
            start = max(0, min(bucket.context_len, self.model.limits.max_seq_len) - bucket.seq_len)
            return self.pad_prefill(0, ids, start, Origin.WARMUP)
        tokens = torch.randint(0, vocab, (bucket.batch_size,), generator=gen).tolist()
        positions = torch.randint(0, bucket.context_len, (bucket.batch_size,), generator=gen)
        positions[0] = bucket.context_len - 1
        return self.pad_decode(tokens, positions.tolist(), Origin.WARMUP)
